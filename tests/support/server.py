"""A ``shardline serve`` process as tests drive it: on a free port, its address read from its
banner, stopped with SIGTERM and every rank process checked gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from shardline.conformance.executors.checks import alive, wait_gone
from support.cli import ROOT, SHARDLINE
from support.processes import descendant_commands

#: Seconds a server may take to print its banner.
START_S = 90.0


class Server:
    """A ``shardline serve`` process on a free port (``--port 0``; the address is read from
    its banner), stopped at the end (:meth:`stop`). ``background``: started with SIGINT
    ignored, as a shell starts a background job; ``env``: variables set beside this process's
    own."""

    def __init__(
        self,
        log: Path,
        overrides: list[str],
        *flags: str,
        background: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [SHARDLINE, "serve", "--port", "0", *flags]
        for item in overrides:
            command += ["--set", item]
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            preexec_fn=_ignore_sigint if background else None,
        )
        self.url = self._wait_for_banner()

    def _wait_for_banner(self) -> str:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            found = re.search(r"at (http://\S+)/v1 ", self.log.read_text())
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server did not start:\n{self.log.read_text()}")

    def workers(self) -> list[int]:
        """Live rank processes of this server (rank order)."""
        found = {}
        for child, command in descendant_commands(self.process.pid).items():
            rank = re.search(r"shardline-worker-(\d+)", command)
            if rank:
                found[int(rank.group(1))] = child
        return [found[r] for r in sorted(found)]

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        """Stop the server with ``how`` (SIGTERM, or SIGINT as Ctrl-C sends); it must exit
        with the shell's code for that signal (143, 130) and take every worker with it."""
        workers = self.workers()
        running = self.process.poll() is None
        if running:
            self.process.send_signal(how)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        left = wait_gone(workers, 5.0)
        for pid in alive(left):
            os.kill(pid, signal.SIGKILL)
        self._log_file.close()
        assert left == [], f"workers {left} outlived the server"
        if running:
            assert self.process.returncode == 128 + how, self.log.read_text()[-2000:]

    def metric(self, name: str, labels: str = "", key: str | None = None) -> float:
        """One sample of GET /metrics (0 when it is not there yet)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
