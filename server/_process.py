"""Run `stoker serve` as a child process: for scripts, notebooks, benchmarks and tests.

start() returns once the server printed its ready line (its ports are known then), never
after a guessed sleep; stop() sends a real signal and waits for the exit code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class ServerProcess:
    """A data server in a child process.

        with ServerProcess("config.yaml", workers=2) as server:
            loader = RemoteLoader(server.address, ...)
    """

    def __init__(self, config: str | os.PathLike[str], *, workers: int | None = None,
                 host: str = "127.0.0.1", port: int = 0, http_port: int = 0,
                 env: dict[str, str] | None = None, log_level: str = "WARNING",
                 wrap: Sequence[str] = ()) -> None:
        # wrap: a command prefix, e.g. ["prlimit", "--nofile=256:256", "--"]; it must exec the
        # server in the end, so that signals and the exit code are the server's own.
        self.args = [*wrap, sys.executable, "-m", "stoker.server", "serve", "--config", str(config),
                     "--host", host, "--port", str(port), "--http-port", str(http_port),
                     "--log-level", log_level]
        if workers is not None:
            self.args += ["--workers", str(workers)]
        self.host = host
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        self.stdout: list[str] = []
        self._ready = threading.Event()
        self._readers: list[threading.Thread] = []
        self._stderr: list[str] = []
        self._stderr_grew = threading.Condition()  # notified on each line of stderr

    @property
    def address(self) -> str:
        return f"{self._host}:{self.ready['grpc_port']}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.ready.get("tls") else "http"
        return f"{scheme}://{self._host}:{self.ready['http_port']}"

    @property
    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def start(self, timeout: float = 120.0) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=self.env, cwd=os.getcwd())
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._readers:
            t.start()
        if not self._ready.wait(timeout) or not self.ready:
            code = self.proc.poll()
            if code is None:
                self.proc.kill()
            self._reap()
            raise RuntimeError("stoker serve did not become ready (exit code "
                               f"{self.proc.returncode})\n{self.stderr}")
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig` and wait for the exit; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self._reap()
                raise RuntimeError(f"stoker serve did not stop within {timeout}s of {sig!r}"
                                   f"\n{self.stderr}") from None
        self._reap()
        return self.proc.returncode

    def _reap(self) -> None:
        """Wait for the exit, read what it printed to the end, close the pipes."""
        assert self.proc is not None
        self.proc.wait()
        for t in self._readers:
            t.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            if not self.ready and line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == "ready":
                    self.ready = event
                    self._ready.set()
        self._ready.set()  # exited: start() reports it

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._stderr_grew:
                self._stderr.append(line)
                self._stderr_grew.notify_all()

    def wait_for_stderr(self, pattern: str, timeout: float = 30.0) -> str:
        """stderr once a line matches the regular expression `pattern` (re.MULTILINE);
        TimeoutError, with stderr, if none does within `timeout` s."""
        regex = re.compile(pattern, re.MULTILINE)
        with self._stderr_grew:
            if not self._stderr_grew.wait_for(lambda: regex.search(self.stderr), timeout):
                raise TimeoutError(f"no line of the server's stderr matches {pattern!r} in "
                                   f"{timeout:g}s:\n{self.stderr}")
        return self.stderr

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()


def write_config(path: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """Write a config mapping as YAML (a convenience for scripts that build configs)."""
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
