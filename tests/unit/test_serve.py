"""What `sluice serve` hands each worker process, and how it fails to start."""

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.cli import service
from sidecar.engine import Engine
from sidecar.request import CheckRequest
from sidecar.server import YOUNG_GENERATION_THRESHOLD, freeze_loaded_objects, tune_garbage_collector
from tests.unit.conftest import ruleset_from


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


KEYED_RULE = """
rules:
  - id: api-key
    key: [ip, "header:x-api-key"]
    limit: {requests: 1000, per: 10s}
    action: block
"""


def test_keys_stored_after_start_leave_the_garbage_collector() -> None:
    """At start, what is loaded is frozen once collections stop untracking:
    a rule's key prefix (a tuple holding its dimensions' tuple) is then
    untracked, and so is every key a decision stores, at its first young
    collection. A prefix frozen tracked would keep each stored key tracked
    for its life: walked by every full collection, unlinked at eviction."""
    threshold = gc.get_threshold()
    tune_garbage_collector()  # as serve does, before it loads the rules
    engine = Engine(ruleset_from(KEYED_RULE))
    try:
        freeze_loaded_objects()
        for n in range(50):
            engine.decide_now(CheckRequest("GET", "example.com", "/", {"x-api-key": f"key-{n}"},
                                           engine.resolve_client(f"192.0.2.{n}", None), "r"))
        # The compiled map keeps a key's items and makes its tuple anew when
        # listed: the keys are listed first, then collected, as stored ones are.
        keys = [key for key, _ in engine.store.table.states.items()]
        gc.collect(0)
        assert len(keys) == 50
        assert not gc.is_tracked(keys[0][0])  # the rule's prefix
        assert [key for key in keys if gc.is_tracked(key)] == []
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.parametrize("udp", [False, True], ids=["port", "hook-udp"])
def test_a_second_sluice_on_the_same_addresses_exits_with_one_line_naming_the_option(
        tmp_path: Path, udp: bool) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM) as first:
        first.bind(("127.0.0.1", 0))
        if not udp:
            first.listen()
        busy = first.getsockname()[1]
        with socket.socket() as other:  # a free check port, for the hook-udp case
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        argv = ["--port", str(free), "--hook-udp", f"127.0.0.1:{busy}"] if udp else \
            ["--port", str(busy), "--hook-udp", "off"]
        try:
            second = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--config", str(rules), *argv],
                                    capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the second sluice serve started on an address in use")
    option = "--hook-udp" if udp else "--port"
    assert second.returncode == 1 and second.stdout == ""
    [line] = second.stderr.splitlines()
    assert line.startswith(f"error: {option}: cannot listen on 127.0.0.1:{busy}")
    assert "address already in use" in line
