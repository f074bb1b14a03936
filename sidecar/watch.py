"""Reloading the rules file when it changes (``sluice serve --watch-interval``).

The file is polled: ``os.stat`` of its path, following every symlink, at
each interval. Polling sees every way a rules file is replaced, as a new
(device, inode, modification time, size):

* a write in place (a new size or modification time);
* an editor's new file renamed over the old one (a new inode);
* a Kubernetes ConfigMap update. The mounted ``rules.yaml`` is a symlink to
  ``..data/rules.yaml``, and ``..data`` a symlink to a timestamped folder;
  the kubelet writes a new folder, renames a new ``..data_tmp`` symlink over
  ``..data`` (atomic) and deletes the old folder. Nothing at the watched path
  itself changes, so an inotify watch of it (not in the standard library
  anyway) would miss it; its stat, through the links, is the new file's.

A change is loaded once the file has stayed the same for one more interval,
so that a file being written in place is not loaded half-written (a rename
or the kubelet's swap is never half-written; it only waits one interval).
The content's digest is then compared with that of the last content loaded
or refused: a touch, or a ConfigMap update that changed another key only,
reloads nothing.

The reload is SIGHUP's (``sidecar.admin.Admin.reload``): valid rules run at
once and keep the counters; an invalid file is refused with every error as
FILE:LINE, the old rules keep running, and the next change is tried again.
A file that disappears keeps the old rules too, and says so.

Each worker process (``--workers``) watches and reloads its own rules, as
each worker process reloads on its own SIGHUP.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("sluice")

DEFAULT_INTERVAL = 2.0
# A shorter interval would spend the event loop on stat calls for nothing.
SHORTEST_INTERVAL = 0.1


@dataclass(frozen=True, slots=True)
class FileVersion:
    """What tells a new file at a path from the old one, through symlinks."""

    device: int
    inode: int
    mtime_ns: int
    size: int


def file_version(path: str) -> FileVersion | None:
    """The version of the file at ``path``; None when there is none (or a
    link of the way leads nowhere)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return FileVersion(stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)


def content_digest(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return hashlib.sha256(file.read()).digest()
    except OSError:
        return None


class RulesFileWatch:
    """Calls ``reload`` when the file at ``path`` has changed and settled.

    ``poll`` takes one look; ``run`` polls every ``interval`` seconds, with
    ``sleep`` (injectable: tests drive the polls themselves)."""

    def __init__(self, path: str, interval: float, reload: Callable[[], object],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.path = path
        self.interval = interval
        self._reload = reload
        self._sleep = sleep
        # The file as the last poll saw it, and as it was last acted on (at
        # start: the file the running rules were loaded from).
        self._seen = self._settled = file_version(path)
        # Of the content last loaded or refused.
        self._digest = content_digest(path)

    def poll(self) -> bool:
        """One look at the file; True when it was reloaded (or refused)."""
        version = file_version(self.path)
        previous, self._seen = self._seen, version
        if version is None:
            if previous is not None:
                log.warning("the rules file %s is gone (or cannot be read); the rules loaded last keep "
                            "running until it is back", self.path)
            return False
        if version != previous or version == self._settled:
            return False  # still changing, or nothing new
        self._settled = version
        digest = content_digest(self.path)
        if digest is None or digest == self._digest:
            return False
        self._digest = digest
        self._reload()
        return True

    async def run(self) -> None:
        """Poll until cancelled. A failure of one poll is logged; the
        watch goes on."""
        while True:
            await self._sleep(self.interval)
            try:
                self.poll()
            except Exception:
                log.exception("watching the rules file %s failed; the rules loaded last keep running", self.path)
