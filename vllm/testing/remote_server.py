# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Start `vllm serve` as a real subprocess on a free loopback port (tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m vllm.entrypoints.cli.main serve MODEL ...`, its output in a log file.

    `stop()` sends SIGTERM and, if it does not exit in time, kills it and every process it
    started (only those). As a context manager it stops on exit, whatever happened inside
    (`wait_ready()` stays the caller's, so several servers can start at once)."""

    def __init__(
        self,
        model: str,
        args: list[str] | tuple[str, ...] = (),
        log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> None:
        self.port = free_port()
        self.host = "127.0.0.1"
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/vllm-serve-{self.port}.log")
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *args,
        ]
        full_env = {**os.environ, **(env or {})}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd
        )
        self._children: list[psutil.Process] = []
        self._stage_pids: list[int] = []

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout=30)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Poll /health until 200; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} while starting:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    self._children = self.children()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stage_pids(self) -> list[int]:
        """Pids of the worker processes (one per stage at TP = 1), as the server logged them at
        start-up."""
        if not self._stage_pids:
            try:
                text = self.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            # "started N worker processes (TP t x PP p; pids [..])": one per worker, TP inner.
            m = re.search(
                r"started \d+ worker (?:processes|actors on Ray) \([^;]*; pids \[([\d, ]+)\]\)",
                text,
            )
            self._stage_pids = [int(x) for x in m.group(1).split(",")] if m else []
        return list(self._stage_pids)

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of the API server and of every stage process, in MiB."""
        out = {}
        for name, pid in [("api_server", self.proc.pid)] + [
            (f"stage{i}", pid) for i, pid in enumerate(self.stage_pids())
        ]:
            try:
                out[name] = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                out[name] = float("nan")
        return out

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait up to timeout, then SIGKILL it and its children. Returns the exit code."""
        known = {p.pid: p for p in self._children + self.children()}
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                rc = None
        for p in known.values():
            try:
                p.kill()
            except psutil.Error:
                pass
        self._log.close()
        return rc


@contextlib.contextmanager
def serving(servers: dict[str, RemoteServer]) -> Iterator[dict[str, RemoteServer]]:
    """Stop every server on exit (also when one of them failed to start)."""
    with contextlib.ExitStack() as stack:
        for srv in servers.values():
            stack.enter_context(srv)
        yield servers
