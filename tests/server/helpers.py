"""Server fixtures: a real `ft serve` subprocess, or the app on a uvicorn thread (fake engine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that was free a moment ago. NOTE: another process may take it before the server
    binds it (our own clients' outgoing connections draw from the same range), so ServeProcess
    retries on 'address in use' and ThreadServer binds its socket itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_socket() -> socket.socket:
    """A listening-ready socket on a port the kernel picked (no window for anyone to take it)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def wait_healthy(base: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"ft serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base}/health not ready after {timeout} s")


class ServeProcess:
    """`ft serve ARGS` on a free port; logs go to a file shown when a test fails."""

    ATTEMPTS = 3  # new ports after 'address already in use' (see free_port)

    def __init__(self, *args: str, log_dir: Path) -> None:
        self.args, self.log_dir = args, log_dir
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = self.log_dir / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--port", str(self.port),
               "--no-show-progress", *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     cwd=REPO, env=env)

    def _port_taken(self) -> bool:
        return self.proc.poll() is not None and "address already in use" in self.log.read_text(
            errors="replace").lower()

    def wait(self, timeout: float = 300) -> ServeProcess:
        for attempt in range(self.ATTEMPTS):
            try:
                wait_healthy(self.base, timeout, self.proc)
                return self
            except Exception:
                if self._port_taken() and attempt + 1 < self.ATTEMPTS:
                    self._start()
                    continue
                sys.stderr.write(self.log.read_text(errors="replace")[-4000:])
                self.stop()
                raise
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ThreadServer:
    """An ASGI app on uvicorn in a thread (for the fake-engine tests)."""

    def __init__(self, app, wait: bool = True) -> None:
        import uvicorn

        self.sock = bound_socket()
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        if wait:
            wait_healthy(self.base, 60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def metric(base: str, name: str, default: float | None = None, **labels: str) -> float:
    """One sample of /metrics (the sum over series when labels leave some open).

    `default` is returned for a series that does not exist (yet); else that is a KeyError.
    """
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    total, seen = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total, seen = total + s.value, True
    if not seen and default is not None:
        return default
    if not seen:
        raise KeyError(f"metric {name} {labels} not in /metrics")
    return total
