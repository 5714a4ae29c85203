"""`ft generate` and `ft chat` through the CLI entry point, on the packaged default model."""

from __future__ import annotations

import io
import re
import sys

import pytest

from freetoken import cli


def test_generate_streams_the_chat_answer(capsys):
    rc = cli.main(["generate", "Say hi.", "--max-tokens", "3", "--no-show-progress"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip()
    line = re.search(r"\[prompt: (\d+) tokens in [\d.]+ s, ([\d.]+) tokens/s; "
                     r"decode: 2 tokens in [\d.]+ s, ([\d.]+) tokens/s\]", err)
    assert line, err  # the speed line: 3 tokens = the first (after the prompt) + 2 decoded
    assert int(line[1]) > 3 and float(line[2]) > 0 and float(line[3]) > 0


def test_generate_plain_and_bad_flags(capsys):
    rc = cli.main(["generate", "1, 2, 3,", "--no-chat", "--max-tokens", "2",
                   "--temperature", "0", "--no-show-progress"])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.startswith(" 4")
    rc = cli.main(["generate", "x", "--max-tokens", "100000", "--no-show-progress"])
    assert rc == 1 and "max_tokens=100000" in capsys.readouterr().err


def test_chat_keeps_history_and_exits(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/reset\nHi again\n/exit\n"))
    rc = cli.main(["chat", "--max-tokens", "2", "--no-show-progress"])
    out, err = capsys.readouterr()
    assert rc == 0 and "/exit quits" in err
    assert out.count("> ") >= 4  # one prompt per line read


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_generate_logs_the_moe_backend_choice(capfd):
    """`auto`'s choice and its reason reach the terminal (log lines on stderr)."""
    from pathlib import Path

    gguf = Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3_moe_q4k-mxfp4.gguf"
    rc = cli.main(["generate", "1, 2, 3", "--model", str(gguf), "--no-chat", "--max-tokens", "2",
                   "--no-show-progress"])
    err = capfd.readouterr().err
    assert rc == 0 and "MoE backend fused (auto: every expert fits" in err, err
