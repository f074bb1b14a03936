"""Processes the tests start themselves (a CrowdSec Local API, a flood's
proxies, a Sluice fed junk), ended the same way."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL when it has not exited within ``timeout``
    seconds; nothing for a process already ended (or none)."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
