"""A folder laid out and updated as the kubelet does a ConfigMap volume
(its AtomicWriter): for the tests of the rules file's watch."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


class ConfigMapVolume:
    """Each key is a symlink ``KEY -> ..data/KEY``; ``..data`` is a symlink
    to a timestamped folder holding the files. An update writes a new
    timestamped folder, points a new ``..data_tmp`` symlink at it, renames
    that over ``..data`` (atomic), removes the links of keys that are gone
    and deletes the old folder: the files' own paths never change."""

    def __init__(self, root: Path, files: dict[str, str]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._versions = 0
        self._folder = self._write(files)
        os.symlink(self._folder.name, root / "..data")
        self._link(files)

    def path(self, key: str) -> Path:
        return self.root / key

    def update(self, files: dict[str, str]) -> None:
        old = self._folder
        self._folder = self._write(files)
        os.symlink(self._folder.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")
        self._link(files)
        for link in self.root.iterdir():
            if link.is_symlink() and not link.name.startswith("..") and link.name not in files:
                link.unlink()
        shutil.rmtree(old)

    def _write(self, files: dict[str, str]) -> Path:
        self._versions += 1
        folder = self.root / f"..{time.strftime('%Y_%m_%d_%H_%M_%S', time.gmtime())}.{self._versions:09d}"
        folder.mkdir()
        for key, text in files.items():
            (folder / key).write_text(text, encoding="utf-8")
        return folder

    def _link(self, files: dict[str, str]) -> None:
        for key in files:
            if not self.path(key).is_symlink():
                os.symlink(f"..data/{key}", self.path(key))
