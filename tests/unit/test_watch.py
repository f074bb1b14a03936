"""The rules file's watch (``sluice serve --watch-interval``): every way a
file is replaced is reloaded as SIGHUP reloads it (counters kept, a bad
file refused with its errors); a touch, a file being written or a file
that is gone are not. The polls are driven by the tests."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sidecar import cli
from sidecar.admin import Admin
from sidecar.app import SluiceApp
from sidecar.engine import ALLOW, DENY
from sidecar.rules import load_ruleset
from sidecar.watch import DEFAULT_INTERVAL, RulesFileWatch

from .configmap_volume import ConfigMapVolume
from .conftest import Harness

# A day's window: the integration tests count on the wall clock, and a
# sliding window's boundary between their checks (a minute's fell there now
# and then on a busy machine) lets the previous window's count fade.
RULES = """\
rules:
  - id: api
    key: [ip]
    limit: {requests: 3, per: 1d}
    action: block
"""
FIVE = RULES.replace("requests: 3", "requests: 5")
BROKEN = RULES.replace("per: 1d", "per: whenever")


class Watched:
    """An engine running the rules of ``path``, and its admin's watch."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.harness = Harness(RULES)
        self.harness.engine.ruleset = load_ruleset(str(path))
        self.admin = Admin(self.harness.engine, str(path), watch_interval=DEFAULT_INTERVAL)
        assert self.admin.file_watch is not None
        self.watch = self.admin.file_watch

    def polls(self, count: int) -> list[bool]:
        """What each of ``count`` polls did: True when it reloaded (or refused)."""
        return [self.watch.poll() for _ in range(count)]

    @property
    def limit(self) -> int:
        return self.harness.engine.ruleset.rules[0].threshold

    def reloads(self, result: str) -> int:
        return self.harness.engine.metrics.reloads[result].value

    def outcomes(self, count: int, ip: str = "192.0.2.1") -> list[str]:
        return self.harness.outcomes(count, ip=ip)


def write_later(path: Path, text: str) -> None:
    """Write ``text`` in place, as a later write would be: with a later
    modification time than the file had, whatever the clock's resolution."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return path


def test_an_unchanged_file_is_never_reloaded(rules: Path) -> None:
    watched = Watched(rules)
    assert watched.polls(5) == [False] * 5
    assert watched.reloads("success") == watched.reloads("failure") == 0


def test_a_write_in_place_is_reloaded_once_settled_and_keeps_the_counters(rules: Path) -> None:
    watched = Watched(rules)
    assert watched.outcomes(2) == [ALLOW, ALLOW]
    write_later(rules, FIVE)
    # Seen changed at the first poll, the same at the second: loaded then.
    assert watched.polls(4) == [False, True, False, False]
    assert watched.limit == 5 and watched.reloads("success") == 1
    assert watched.outcomes(4) == [ALLOW] * 3 + [DENY]


def test_a_new_file_renamed_over_the_old_one_is_reloaded(rules: Path) -> None:
    watched = Watched(rules)
    new = rules.with_name(".rules.yaml.swp")
    new.write_text(FIVE)
    os.replace(new, rules)
    assert watched.polls(3) == [False, True, False]
    assert watched.limit == 5


def test_a_configmap_update_is_reloaded_though_the_watched_path_never_changes(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "config", {"rules.yaml": RULES})
    watched = Watched(volume.path("rules.yaml"))
    assert watched.outcomes(2) == [ALLOW, ALLOW]
    link = os.lstat(volume.path("rules.yaml"))
    volume.update({"rules.yaml": FIVE})
    # The kubelet changed nothing at the path itself: its link is the same link.
    assert os.lstat(volume.path("rules.yaml")) == link
    assert watched.polls(3) == [False, True, False]
    assert watched.limit == 5
    assert watched.outcomes(4) == [ALLOW] * 3 + [DENY]


def test_a_configmap_update_of_another_key_only_reloads_nothing(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "config", {"rules.yaml": RULES, "page.html": "<p>slow down</p>"})
    watched = Watched(volume.path("rules.yaml"))
    volume.update({"rules.yaml": RULES, "page.html": "<p>later</p>"})
    assert watched.polls(4) == [False] * 4
    assert watched.reloads("success") == 0


def test_a_touch_reloads_nothing(rules: Path) -> None:
    watched = Watched(rules)
    write_later(rules, RULES)
    assert watched.polls(4) == [False] * 4
    assert watched.reloads("success") == 0


def test_a_file_still_being_written_is_loaded_only_once_it_stops_changing(rules: Path) -> None:
    watched = Watched(rules)
    done = 0
    for end in range(len(FIVE) // 4, len(FIVE) + 1, len(FIVE) // 4):
        write_later(rules, FIVE[:end])  # a slow copy, one piece between two polls
        done = end
        assert watched.polls(1) == [False]
    if done < len(FIVE):
        write_later(rules, FIVE)
        assert watched.polls(1) == [False]
    assert watched.polls(2) == [True, False]
    assert watched.reloads("failure") == 0 and watched.limit == 5


def test_a_half_written_file_caught_settled_is_refused_and_the_rest_of_the_write_retried(
        rules: Path, caplog: pytest.LogCaptureFixture) -> None:
    watched = Watched(rules)
    write_later(rules, FIVE[:FIVE.index("action")].replace("requests: 5, ", ""))
    assert watched.polls(2) == [False, True]
    assert watched.reloads("failure") == 1 and watched.limit == 3
    assert "reload refused, the old rules keep running" in caplog.text
    write_later(rules, FIVE)
    assert watched.polls(2) == [False, True]
    assert watched.reloads("success") == 1 and watched.limit == 5


def test_a_bad_file_keeps_the_old_rules_with_every_error_then_the_fixed_file_runs(
        rules: Path, caplog: pytest.LogCaptureFixture) -> None:
    watched = Watched(rules)
    assert watched.outcomes(2) == [ALLOW, ALLOW]
    write_later(rules, BROKEN)
    assert watched.polls(2) == [False, True]
    assert f"{rules}:4: rules[0](api).limit.per: " in caplog.text
    assert watched.reloads("failure") == 1 and watched.limit == 3
    assert watched.outcomes(4, ip="192.0.2.2") == [ALLOW] * 3 + [DENY]  # the old rules run
    # The same bad file is not tried again at every poll.
    assert watched.polls(3) == [False] * 3 and watched.reloads("failure") == 1
    write_later(rules, FIVE)
    assert watched.polls(2) == [False, True]
    assert watched.reloads("success") == 1 and watched.limit == 5
    assert watched.outcomes(4) == [ALLOW] * 3 + [DENY]  # the 2 counted before are still counted


def test_a_deleted_file_keeps_the_old_rules_says_so_once_and_its_return_is_reloaded(
        rules: Path, caplog: pytest.LogCaptureFixture) -> None:
    watched = Watched(rules)
    rules.unlink()
    assert watched.polls(3) == [False] * 3
    gone = [record for record in caplog.records if "is gone" in record.getMessage()]
    assert len(gone) == 1 and gone[0].levelname == "WARNING" and str(rules) in gone[0].getMessage()
    assert watched.limit == 3 and watched.reloads("failure") == 0
    rules.write_text(FIVE)
    assert watched.polls(2) == [False, True]
    assert watched.limit == 5


def test_a_key_removed_from_the_configmap_keeps_the_old_rules(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    volume = ConfigMapVolume(tmp_path / "config", {"rules.yaml": RULES})
    watched = Watched(volume.path("rules.yaml"))
    volume.update({"other.yaml": "x: 1\n"})
    assert watched.polls(2) == [False, False]
    assert "is gone" in caplog.text and watched.limit == 3


def test_each_reload_is_audited_as_asked_by_the_file(rules: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    watched = Watched(rules)
    write_later(rules, FIVE)
    watched.polls(2)
    assert '"audit":"reload","who":"file","result":"reloaded"' in caplog.text


def test_run_polls_at_its_interval_with_the_sleep_it_is_given(rules: Path) -> None:
    reloads: list[str] = []
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            write_later(rules, FIVE)
        if len(slept) == 6:
            raise asyncio.CancelledError

    watch = RulesFileWatch(str(rules), 1.5, lambda: reloads.append(rules.read_text()), sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(watch.run())
    assert slept == [1.5] * 6
    # Changed before the second poll, the same at the third: loaded then, once.
    assert reloads == [FIVE]


def test_a_poll_that_fails_is_logged_and_the_watch_goes_on(rules: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def reload() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    slept = 0

    async def sleep(_: float) -> None:
        nonlocal slept
        slept += 1
        if slept in (1, 4):
            write_later(rules, FIVE if slept == 1 else RULES)
        if slept == 7:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(RulesFileWatch(str(rules), 1, reload, sleep=sleep).run())
    assert len(calls) == 2
    assert "watching the rules file" in caplog.text and "RuntimeError: boom" in caplog.text


def test_no_watch_without_a_rules_file_or_with_an_interval_of_0(rules: Path) -> None:
    engine = Harness(RULES).engine
    assert Admin(engine, None, watch_interval=2).file_watch is None
    assert Admin(engine, str(rules), watch_interval=0).file_watch is None
    assert Admin(engine, str(rules)).file_watch is None  # an Admin of its own (tests, embedding) does not watch


def test_the_service_watches_while_it_runs(rules: Path) -> None:
    """The lifespan of the service starts the watch, and stops it."""
    watched = Watched(rules)
    watched.watch.interval = 0.1  # real polls here: a real event loop
    app = SluiceApp(watched.harness.engine, admin=watched.admin)

    async def run() -> None:
        async with app.api.router.lifespan_context(app.api):
            write_later(rules, FIVE)
            deadline = time.monotonic() + 10
            while watched.limit != 5:
                assert time.monotonic() < deadline, "the change was not reloaded within 10 s"
                await asyncio.sleep(0.02)
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        assert tasks == []

    asyncio.run(run())
    assert watched.reloads("success") == 1


# --------------------------------------------------------------------------
# sluice serve
# --------------------------------------------------------------------------


def serve(rules: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(cli.main, ["serve", "--config", str(rules), *args], env=env or {})


def test_serve_watches_its_rules_file_every_2_seconds_by_default(rules: Path, served: list) -> None:
    assert serve(rules).exit_code == 0
    assert served[0]["app"]["watch_interval"] == DEFAULT_INTERVAL == 2.0


@pytest.mark.parametrize("args, env, interval", [
    (["--watch-interval", "0.5"], {}, 0.5),
    ([], {"SLUICE_WATCH_INTERVAL": "10"}, 10.0),
    (["--watch-interval", "3"], {"SLUICE_WATCH_INTERVAL": "10"}, 3.0),
    (["--watch-interval", "0"], {}, 0.0),
    (["--no-watch"], {}, 0.0),
    (["--no-watch"], {"SLUICE_WATCH_INTERVAL": "5"}, 0.0),
])
def test_serve_takes_the_watch_interval_from_the_flag_or_the_environment(
        rules: Path, served: list, args: list[str], env: dict[str, str], interval: float) -> None:
    result = serve(rules, *args, env=env)
    assert result.exit_code == 0, result.output
    assert served[0]["app"]["watch_interval"] == interval


@pytest.mark.parametrize("value", ["0.01", "-1", "nan", "inf", "often"])
def test_a_bad_watch_interval_is_one_clear_error(rules: Path, served: list, value: str) -> None:
    result = serve(rules, "--watch-interval", value)
    assert result.exit_code == 2 and not served
    assert "--watch-interval" in result.output and "Traceback" not in result.output


def test_serve_help_names_the_watch_s_environment_variable() -> None:
    assert "SLUICE_WATCH_INTERVAL" in CliRunner().invoke(cli.main, ["serve", "-h"]).output
