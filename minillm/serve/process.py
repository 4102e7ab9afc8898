"""ServerProcess: `python -m minillm serve` as a child process, for notebooks, tests and
benchmarks.

    with ServerProcess(max_num_seqs=8, max_queue_len=4) as server:
        httpx.post(server.url + "/v1/completions", json={...})
    # the server got SIGTERM, drained and was reaped

It picks a free loopback port, waits until `/health/ready` answers (the model is loaded and
its warm-up generation finished: what `ThreadedServer` waits for in-process, and what a
Kubernetes readiness probe asks), and always reaps the child: on `stop()`, on leaving the `with` block
(even through KeyboardInterrupt), at interpreter exit, and - on Linux - when the parent
dies (PR_SET_PDEATHSIG), so an interrupted notebook cell leaves no orphan.
The child's output goes to a temporary log file (`log_text()`), never a pipe that could
fill up and block it.
"""
from __future__ import annotations

import atexit
import os
import signal as _signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import httpx

from .config import ServeConfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, _signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class ServerProcess:
    def __init__(self, port: int | None = None, startup_timeout_s: float = 180.0,
                 env: dict | None = None, **options):
        unknown = sorted(set(options) - set(ServeConfig.option_names()) - {"host"})
        if unknown:
            raise TypeError(f"unknown server option(s) {unknown}; the options are "
                            f"{list(ServeConfig.option_names())}")
        self.config = ServeConfig(**{**options, "host": "127.0.0.1",
                                     "port": port or free_port()})
        self.url = f"http://127.0.0.1:{self.config.port}"
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="minillm-serve-", suffix=".log",
                                                delete=False)
        cmd = [sys.executable, "-m", "minillm", "serve", *self.config.cli_args()]
        child_env = {**os.environ, **(env or {})}
        child_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=child_env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        atexit.register(self._finalizer)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop(_signal.SIGKILL, 5)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} "
                                   f"while starting; its log ends:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health/ready", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready (/health/ready) within {timeout_s} s; "
                           f"its log ends:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        with open(self._log.name, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, signal: int = _signal.SIGTERM, timeout_s: float | None = None) -> int:
        """Send `signal`, wait up to timeout_s (default: the drain timeout + 15 s), then
        kill. Returns the exit code (0 after a clean drain)."""
        if timeout_s is None:
            timeout_s = self.config.drain_timeout_s + 15
        if self.proc.poll() is None:
            self.proc.send_signal(signal)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
        self._finalizer()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"ServerProcess({self.url}, pid {self.pid}, {state})"
