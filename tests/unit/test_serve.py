"""What `sluice serve` hands each worker process."""

import gc
import os
from pathlib import Path

from sidecar.cli import service
from sidecar.server import YOUNG_GENERATION_THRESHOLD


def settings(rules: Path, secret: str | None) -> dict:
    return {"config": str(rules), "admin_token_file": None, "hook_udp": None, "loopback": True,
            "log_level": "warning", "workers": 2, "secret": secret}


def test_workers_share_one_signing_key_without_a_secret_file(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    shared = os.urandom(32).hex()
    first, second = service(settings(rules, shared)), service(settings(rules, shared))
    token = first.engine.pending.issue([("r", 1.0, ("192.0.2.1",))])
    # A report may reach any worker: the other one must accept the token.
    assert second.engine.pending.open(token).counts == [("r", 1.0, ("192.0.2.1",))]
    credential = first.engine.challenges.credential("r", "192.0.2.1", "", 3600)
    assert second.engine.challenges.accepts(credential, "r", "192.0.2.1", "")
    # Without the shared key, each process would pick its own.
    third = service(settings(rules, None))
    assert third.engine.pending.open(token) is None


def test_each_process_collects_young_objects_in_large_batches(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        service(settings(rules, None))
        assert gc.get_threshold()[0] == YOUNG_GENERATION_THRESHOLD > 700
    finally:
        gc.set_threshold(*before)
