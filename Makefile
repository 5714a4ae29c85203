# `make run` and `make test` do all set-up themselves (scripts/setup.sh, idempotent).
VENV := .venv
PROMPT ?= Write a haiku about the sea.

.PHONY: setup run test lint
setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/ft generate "$(PROMPT)"

test: setup
	$(VENV)/bin/ruff check freetoken tests benchmarks scripts
	$(VENV)/bin/python -m pytest -q -ra --durations=15

lint: setup
	$(VENV)/bin/ruff check freetoken tests benchmarks scripts
