"""envoyproxy/ratelimit's README examples through a real Envoy and a real Sluice.

One Envoy (rls/envoy-rls-examples.yaml.template) runs the
``envoy.filters.http.ratelimit`` filter in front of the demo upstream and asks
``sluice serve --grpc-port --rls-config rls/config`` (the Rate Limit Service,
``envoy.service.ratelimit.v3``) about every request. Each file of rls/config
is one README example, verbatim, under a route of its own whose
``rate_limits`` make the README's descriptors from ``generic_key``,
``request_headers`` and ``remote_address`` actions. The tests assert what the
README says each example does, as a client of Envoy sees it: 200 or 429, and
the ``x-ratelimit-*`` headers (DRAFT_VERSION_03) Envoy writes from Sluice's
answer. Three files add what envoyproxy/ratelimit cannot do (Sluice's
``sluice:`` key): a sliding window and a token bucket.

The stack is started once for the module, so counters are shared: every test
counts by values (numbers, users, addresses) no other test uses.

Windows: Sluice aligns a fixed window to multiples of its unit since the
Unix epoch, as envoyproxy/ratelimit does (test_windows_are_aligned_to_the_unix_epoch).
A test that needs its requests in one window waits until enough of one is
left, and checks afterwards that it stayed there: such sleeps only
synchronize, they never stand in for an assertion.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from devstack.launcher import START_TIMEOUT_SECONDS, Component, StackError, accepts_connections, find_envoy, http_status
from sidecar.frontdoors.messages import SERVING, HealthCheckRequest, HealthCheckResponse
from sidecar.rendering import render_template
from tests.integration.clients import LOOPBACK, Client, Reply
from tests.integration.conftest import free_port, metric_at, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RLS = Path(__file__).parent / "rls"
CONFIG = RLS / "config"
ENVOY_TEMPLATE = RLS / "envoy-rls-examples.yaml.template"

# envoyproxy/ratelimit's statistics of each descriptor.
STATS = ("total_hits", "within_limit", "near_limit", "over_limit", "shadow_mode")
LIMIT_HEADERS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
# A window stretch is tried this many times before the test gives up (each
# try that ran into a window boundary is thrown away).
WINDOW_ATTEMPTS = 3
# How long a poll for a refill or a new window may take: far more than the
# half second or two the tests' limits need.
POLL_SECONDS = 3.0
POLL_INTERVAL_SECONDS = 0.01

T = TypeVar("T")


# --------------------------------------------------------------------------
# The stack: demo upstream, Sluice, Envoy
# --------------------------------------------------------------------------


class RlsStack:
    """The demo upstream, ``sluice serve`` with the RLS configurations of
    rls/config, and Envoy with the ratelimit filter asking it; started in
    that order, stopped in reverse. Logs go to ``run_dir/logs``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.envoy_port, self.envoy_admin_port = free_port(), free_port()
        self.sluice_port, self.sluice_grpc_port, self.upstream_port = free_port(), free_port(), free_port()
        self.components: dict[str, Component] = {}

    @property
    def sluice_log(self) -> Path:
        return self.components["sluice"].log_path

    def start(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        envoy_config = self.run_dir / "envoy.yaml"
        envoy_config.write_text(render_template(ENVOY_TEMPLATE.read_text(), {
            "ENVOY_PORT": str(self.envoy_port), "ENVOY_ADMIN_PORT": str(self.envoy_admin_port),
            "SLUICE_GRPC_PORT": str(self.sluice_grpc_port), "UPSTREAM_PORT": str(self.upstream_port),
        }))
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        try:
            self._start("upstream", [sys.executable, "-m", "devstack.demo_upstream", "--host", LOOPBACK,
                                     "--port", str(self.upstream_port)],
                        env, lambda: http_status(LOOPBACK, self.upstream_port, "/") is not None)
            # --log-level info: the decision log (one line per descriptor
            # over its limit) goes to the log file, for the shadow_mode test.
            self._start("sluice", [sys.executable, "-m", "sidecar", "serve", "--host", LOOPBACK,
                                   "--port", str(self.sluice_port), "--hook-udp", "off",
                                   "--grpc-port", str(self.sluice_grpc_port), "--rls-config", str(CONFIG),
                                   "--log-level", "info"],
                        env, lambda: http_status(LOOPBACK, self.sluice_port, "/healthz") == 200)
            # As devstack.launcher starts Envoy: no hot restart, so no shared
            # memory of a fixed name (stacks of other tests run beside it).
            self._start("envoy", [find_envoy(), "-c", str(envoy_config), "--disable-hot-restart",
                                  "--log-level", "warning", "--concurrency", "2"],
                        env, self._envoy_ready)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("envoy", "sluice", "upstream"):
            component = self.components.pop(name, None)
            if component is not None:
                component.stop()

    def _start(self, name: str, argv: list[str], env: dict[str, str], ready: Callable[[], bool]) -> None:
        component = Component(name, argv, self.run_dir / "logs" / f"{name}.log", env)
        self.components[name] = component
        component.wait_until_ready(ready, START_TIMEOUT_SECONDS)

    def _envoy_ready(self) -> bool:
        # /ready is LIVE once the listeners are set up, even one that could
        # not bind: the listener must take connections too.
        return http_status(LOOPBACK, self.envoy_admin_port, "/ready") == 200 and \
            accepts_connections(LOOPBACK, self.envoy_port)

    # ---- what the tests ask ----

    def get(self, path: str, **headers: str) -> Reply:
        """One GET through Envoy; keyword ``x_user="a"`` is header x-user."""
        return Client(self.envoy_port).request(
            path, headers={name.replace("_", "-"): value for name, value in headers.items()})

    def metric(self, name: str, labels: str = "") -> float:
        return metric_at(self.sluice_port, name, labels)

    def envoy_stat(self, name: str) -> int:
        """One counter of Envoy's admin /stats; 0 before it is first used."""
        connection = http.client.HTTPConnection(LOOPBACK, self.envoy_admin_port, timeout=2.0)
        try:
            connection.request("GET", f"/stats?filter=^{name}$")
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        for line in text.splitlines():
            stat, _, value = line.partition(": ")
            if stat == name:
                return int(value)
        return 0

    def decision_log(self) -> list[dict[str, object]]:
        """Sluice's decision log lines of the Rate Limit Service so far."""
        entries = []
        for line in self.sluice_log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"front_door":"rls"' in line:
                entries.append(json.loads(line))
        return entries


@pytest.fixture(scope="module")
def rls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RlsStack]:
    """The stack, for every test of the module. A port found free can be
    taken before its server binds it: then the stack starts again on other
    ports, up to three times."""
    run_dir = tmp_path_factory.mktemp("rls-envoy")
    for attempt in range(3):
        stack = RlsStack(run_dir / f"attempt-{attempt}")
        try:
            stack.start()
            break
        except StackError:
            if attempt == 2:
                raise
    yield stack
    stack.stop()


@pytest.fixture(autouse=True)
def envoy_never_fails_open(rls: RlsStack) -> Iterator[None]:
    """After each test: no request was let through because Sluice did not
    answer in time or answered with an error (failure_mode_deny: false would
    turn such a 429 into a 200)."""
    yield
    for outcome in ("error", "failure_mode_allowed"):
        assert rls.envoy_stat(f"cluster.application.ratelimit.{outcome}") == 0, \
            f"Envoy's ratelimit filter counted {outcome}: see {rls.run_dir / 'logs'}"


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def limit_headers(reply: Reply) -> tuple[str | None, str | None, str | None]:
    """x-ratelimit-limit, -remaining and -reset of a reply."""
    limit, remaining, reset = (reply.headers.get(name) for name in LIMIT_HEADERS)
    return limit, remaining, reset


def assert_unlimited(reply: Reply) -> None:
    """Let through with no limit: Sluice answered OK with no current_limit,
    so Envoy wrote no x-ratelimit header."""
    assert reply.status == 200
    assert limit_headers(reply) == (None, None, None)


def assert_refused(reply: Reply) -> None:
    assert reply.status == 429
    assert reply.headers["x-envoy-ratelimited"] == "true"
    assert reply.headers["x-ratelimit-remaining"] == "0"


def _windows(period: float) -> int:
    """The current window of ``period`` seconds since the Unix epoch."""
    return int(time.time() // period)


def _room(period: float) -> float:
    """Seconds until the next window boundary."""
    return period - time.time() % period


def wait_for_window(period: float, room: float, fresh: bool) -> None:
    """Sleep until at least ``room`` seconds are left in the current window
    of ``period`` (at most half the period). ``fresh``: only just after a
    boundary, so that the window has none of the hits made before the call."""
    deadline = time.monotonic() + 2 * period + 1
    while fresh or _room(period) < room:
        time.sleep(_room(period) + 0.005)
        fresh = False
        assert time.monotonic() < deadline, "no window stretch found (clock trouble?)"


def in_one_window(period: float, room: float, attempt: Callable[[int], T], fresh: bool = True) -> T:
    """``attempt(n)``'s result, run in one window of ``period`` seconds.
    An attempt that ran into a boundary is thrown away and the
    next, ``attempt(n + 1)``, starts in another window. With ``fresh``
    False, an attempt may start in a window that has seen hits already
    (each attempt must then count by values of its own, n being part of
    them)."""
    for number in range(WINDOW_ATTEMPTS):
        wait_for_window(period, room, fresh)
        windows = _windows(period)
        result = attempt(number)
        if _windows(period) == windows:
            return result
    pytest.fail(f"{WINDOW_ATTEMPTS} tries ran into a window boundary of {period} s: the machine is too slow")


def poll_until_admitted(send: Callable[[], Reply], what: str) -> float:
    """Send until a reply is 200 (the refused ones are not counted); the
    monotonic time of that reply."""
    deadline = time.monotonic() + POLL_SECONDS
    while True:
        reply = send()
        if reply.status == 200:
            return time.monotonic()
        assert_refused(reply)
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still refused after {POLL_SECONDS} s")
        time.sleep(POLL_INTERVAL_SECONDS)


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------
# envoyproxy/ratelimit's README examples
# --------------------------------------------------------------------------


def test_example1_database_users_is_500_per_second_and_another_database_is_unlimited(rls: RlsStack) -> None:
    """Example 1 (mongo_cps): (database,users) counts against 500 a second;
    (database,other), a value the file does not name, has no limit."""

    def two_requests(_: int) -> tuple[Reply, Reply]:
        return rls.get("/mongo/find", x_database="users"), rls.get("/mongo/find", x_database="users")

    first, second = in_one_window(1.0, 0.3, two_requests)
    assert first.status == second.status == 200
    assert limit_headers(first) == ("500, 500;w=1", "499", "1")
    assert limit_headers(second) == ("500, 500;w=1", "498", "1")

    for _ in range(3):
        assert_unlimited(rls.get("/mongo/find", x_database="other"))


def test_example1_a_descriptor_hits_addend_counts_as_that_many_requests(rls: RlsStack) -> None:
    """Example 1's (database,default) from the route /mongo/bulk, whose
    rate_limits item (in the filter's per-route configuration) has
    hits_addend 50: Envoy sends the descriptor with hits_addend 50, each
    request takes 50 of the 500 a second, and the statistics count hits,
    not requests."""
    total = ("ratelimit_service_rate_limit_total_hits", 'domain="mongo_cps",key1="database_default",key2=""')

    def two_bulk_requests(_: int) -> tuple[Reply, Reply, float]:
        before = rls.metric(*total)
        first, second = (rls.get("/mongo/bulk", x_database="default") for _ in range(2))
        return first, second, rls.metric(*total) - before

    first, second, hits = in_one_window(1.0, 0.3, two_bulk_requests)
    assert first.status == second.status == 200
    assert limit_headers(first)[:2] == ("500, 500;w=1", "450")
    assert limit_headers(second)[:2] == ("500, 500;w=1", "400")
    assert hits == 100


def test_example2_five_marketing_messages_a_day_per_number_and_100_messages_a_day(rls: RlsStack) -> None:
    """Example 2 (messaging): a marketing message sends both descriptors;
    the 6th to one number in a day is refused by the 5 a day limit, another
    number still gets its own 5, and a message of another kind sees only
    the 100 a day per number, which the six marketing messages counted too."""
    number, other_number, third_number = "2061111111", "2062222222", "2063333333"

    replies = [rls.get("/messaging/marketing", x_to_number=number) for _ in range(6)]
    assert [reply.status for reply in replies] == [200] * 5 + [429]
    # Envoy's limit header: the limit of the descriptor with the least
    # remaining, then every limit of the answer with its window.
    assert [limit_headers(reply)[:2] for reply in replies[:5]] == [
        ("5, 5;w=86400, 100;w=86400", str(remaining)) for remaining in (4, 3, 2, 1, 0)]
    assert_refused(replies[5])

    another = rls.get("/messaging/marketing", x_to_number=other_number)
    assert another.status == 200
    assert limit_headers(another)[:2] == ("5, 5;w=86400, 100;w=86400", "4")

    plain = rls.get("/messaging/send", x_to_number=third_number)
    assert plain.status == 200
    assert limit_headers(plain)[:2] == ("100, 100;w=86400", "99")
    # Each descriptor counts on its own: the refused 6th marketing message
    # was within its 100 a day, and counted there.
    after_marketing = rls.get("/messaging/send", x_to_number=number)
    assert after_marketing.status == 200
    assert limit_headers(after_marketing)[:2] == ("100, 100;w=86400", str(100 - 6 - 1))


def test_example3_a_blacklisted_address_is_always_refused_others_get_10_per_second(rls: RlsStack) -> None:
    """Example 3 (edge_proxy_per_ip): remote_address 50.0.0.5 has 0 a
    second, refused from its first request; any other address gets 10 a
    second of its own: the 11th in one second is refused, while another
    address in that second is admitted."""
    denials = ("sluice_decisions_total", 'front_door="rls",outcome="deny"')
    denied_before = rls.metric(*denials)
    for _ in range(3):
        assert_refused(rls.get("/edge/login", x_forwarded_for="50.0.0.5"))
    assert rls.metric(*denials) - denied_before == 3

    def burst(attempt: int) -> tuple[list[Reply], Reply, float]:
        address, neighbour = f"50.0.1.{2 * attempt + 1}", f"50.0.1.{2 * attempt + 2}"
        before = rls.metric(*denials)
        replies = [rls.get("/edge/login", x_forwarded_for=address) for _ in range(11)]
        return replies, rls.get("/edge/login", x_forwarded_for=neighbour), rls.metric(*denials) - before

    replies, neighbour, denied = in_one_window(1.0, 0.5, burst)
    assert [reply.status for reply in replies] == [200] * 10 + [429]
    assert [limit_headers(reply)[:2] for reply in replies[:10]] == [
        ("10, 10;w=1", str(remaining)) for remaining in range(9, -1, -1)]
    assert_refused(replies[10])
    assert neighbour.status == 200
    assert limit_headers(neighbour)[:2] == ("10, 10;w=1", "9")
    assert denied == 1


def test_example4_a_nested_configuration_matches_the_two_entry_descriptor(rls: RlsStack) -> None:
    """Example 4: (key,value),(subkey,subvalue) falls under the nested
    configuration's 300 a second, and under no limit of the configuration
    that stops at (key,value)."""
    nested = rls.get("/example4/")
    assert nested.status == 200
    assert limit_headers(nested)[:2] == ("300, 300;w=1", "299")

    assert_unlimited(rls.get("/example4-shallow/"))


def test_example5_ldap_is_unlimited_and_azure_is_100_per_minute(rls: RlsStack) -> None:
    """Example 5 (internal): (ldap, any value) is never limited, however
    often, and shows no limit; (azure, any value) counts against 100 a minute."""
    for _ in range(120):
        assert_unlimited(rls.get("/internal/", x_ldap="directory"))

    azure = rls.get("/internal/", x_azure=unique("tenant-"))
    assert azure.status == 200
    assert limit_headers(azure)[:2] == ("100, 100;w=60", "99")


def test_example6_shadow_mode_never_refuses_user_a_but_counts_its_breaches(rls: RlsStack) -> None:
    """Example 6: user-a's 10 a second is in shadow_mode: 15 requests in
    one second all pass, the 5 over the limit show in
    ratelimit_service_rate_limit_shadow_mode and in Sluice's decision log
    (action shadow); user-b's 20 a second is enforced."""
    shadow = ("ratelimit_service_rate_limit_shadow_mode", 'domain="example6",key1="service",key2="user_user-a"')

    def fifteen(_: int) -> tuple[list[Reply], float]:
        before = rls.metric(*shadow)
        replies = [rls.get("/example6/", x_user="user-a") for _ in range(15)]
        return replies, rls.metric(*shadow) - before

    user_a, breaches = in_one_window(1.0, 0.5, fifteen)
    assert [reply.status for reply in user_a] == [200] * 15
    assert breaches == 5
    wait_until(lambda: any(entry["rule"] == "example6.service.user_user-a" and entry["action"] == "shadow"
                           for entry in rls.decision_log()),
               "a decision log line with action shadow for user-a", 2.0)

    def twenty_one(_: int) -> tuple[list[Reply], dict[str, float]]:
        before = {stat: rls.metric(f"ratelimit_service_rate_limit_{stat}", user_b_labels) for stat in STATS}
        replies = [rls.get("/example6/", x_user="user-b") for _ in range(21)]
        return replies, {stat: rls.metric(f"ratelimit_service_rate_limit_{stat}", user_b_labels) - before[stat]
                         for stat in STATS}

    user_b_labels = 'domain="example6",key1="service",key2="user_user-b"'
    user_b, counted = in_one_window(1.0, 0.5, twenty_one)
    assert [reply.status for reply in user_b] == [200] * 20 + [429]
    assert limit_headers(user_b[19])[:2] == ("20, 20;w=1", "0")
    assert_refused(user_b[20])
    # As envoyproxy/ratelimit counts them: near_limit is the hits past 80 %
    # of the limit (17th to 20th), over_limit the one past it.
    assert counted == {"total_hits": 21, "within_limit": 20, "near_limit": 4, "over_limit": 1, "shadow_mode": 0}


def test_example7_a_limit_that_replaces_another_is_the_only_one_counted(rls: RlsStack) -> None:
    """Example 7: with both descriptors in one request only the 10 a second
    limit (which replaces specific_limit) applies; the 5 a second counter is
    left untouched, as a request with the first descriptor alone shows in
    the same second."""

    def requests(_: int) -> tuple[list[Reply], Reply]:
        both = [rls.get("/example7/both", x_user="bkthomps") for _ in range(3)]
        return both, rls.get("/example7/first", x_user="bkthomps")

    both, first = in_one_window(1.0, 0.3, requests)
    assert [reply.status for reply in both] == [200] * 3
    assert [limit_headers(reply)[:2] for reply in both] == [
        ("10, 10;w=1", remaining) for remaining in ("9", "8", "7")]
    assert first.status == 200
    assert limit_headers(first)[:2] == ('5, 5;w=1;name="specific_limit"', "4")


def test_example9_wildcards_match_values_and_count_each_value_on_its_own(rls: RlsStack) -> None:
    """Example 9: /api/*/action matches /api/123/action and
    /api/user-id/action, each with its own 20 a minute (the 21st of one is
    refused), and not /api/123/other; value* and /api/*/resource/*/action
    match as the README says, and what they do not match has no limit."""
    ids = unique("id-")

    def twenty_one(attempt: int) -> list[Reply]:
        return [rls.get(f"/api/{ids}-{attempt}/action") for _ in range(21)]

    replies = in_one_window(60.0, 2.0, twenty_one, fresh=False)
    assert [reply.status for reply in replies] == [200] * 20 + [429]
    assert limit_headers(replies[0])[:2] == ("20, 20;w=60", "19")
    assert_refused(replies[20])
    for path in (f"/api/{unique('')}/action", f"/api/user-{unique('')}/action"):
        reply = rls.get(path)
        assert reply.status == 200, path
        assert limit_headers(reply)[:2] == ("20, 20;w=60", "19"), path
    for _ in range(25):
        assert_unlimited(rls.get(f"/api/{ids}-0/other"))

    for value in (unique("value"), unique("valueXYZ")):
        assert limit_headers(rls.get("/example9-trailing/", x_key1=value))[:2] == ("20, 20;w=60", "19")
    assert_unlimited(rls.get("/example9-trailing/", x_key1=unique("other")))

    for version in ("v1", "v2"):
        route = f"/api/{version}/resource/{unique('')}/action"
        assert limit_headers(rls.get("/example9-multi/", x_route=route))[:2] == ("20, 20;w=60", "19")
    assert_unlimited(rls.get("/example9-multi/", x_route=f"/api/v1/resource/{unique('')}/other"))


def test_a_domain_no_file_configures_is_not_limited(rls: RlsStack) -> None:
    """The filter's own domain, no_such_domain, is in no file: OK, with no
    limit for Envoy to show."""
    for _ in range(3):
        assert_unlimited(rls.get("/anything/else"))


def test_windows_are_aligned_to_the_unix_epoch(rls: RlsStack) -> None:
    """A day limit resets at 00:00 UTC, as envoyproxy/ratelimit's key
    (the time divided by the unit) makes it: x-ratelimit-reset of Example
    2's 100 a day counts down to midnight UTC."""
    # envoyproxy/ratelimit: unit - now % unit, in whole seconds.
    until_midnight = 86400 - int(time.time()) % 86400
    reply = rls.get("/messaging/send", x_to_number=unique("206"))
    _, _, reset = limit_headers(reply)
    assert reset is not None
    assert abs(int(reset) - until_midnight) <= 1, \
        f"x-ratelimit-reset {reset} s, but 00:00 UTC is {until_midnight} s away"


# --------------------------------------------------------------------------
# What envoyproxy/ratelimit cannot do: Sluice's algorithms
# --------------------------------------------------------------------------


def test_a_sliding_window_refuses_just_after_the_boundary_where_a_fixed_window_admits(rls: RlsStack) -> None:
    """The same 4 per 2 s, window_fixed and window_sliding: both filled
    early in one window; just after the boundary the fixed window admits
    again while the sliding one still weighs the previous window's 4 and
    refuses, admitting only once half a second of the new window has gone."""

    def fill(attempt: int) -> tuple[str, list[Reply], list[Reply]]:
        address = f"50.0.2.{attempt + 1}"
        fixed = [rls.get("/window-fixed/", x_forwarded_for=address) for _ in range(5)]
        sliding = [rls.get("/window-sliding/", x_forwarded_for=address) for _ in range(5)]
        return address, fixed, sliding

    address, fixed, sliding = in_one_window(2.0, 1.0, fill)
    assert [reply.status for reply in fixed] == [200] * 4 + [429]
    assert [reply.status for reply in sliding] == [200] * 4 + [429]

    # The fixed window's next window begins when it admits again.
    reopened = poll_until_admitted(lambda: rls.get("/window-fixed/", x_forwarded_for=address),
                                   "window_fixed after its window")
    assert_refused(rls.get("/window-sliding/", x_forwarded_for=address))
    admitted = poll_until_admitted(lambda: rls.get("/window-sliding/", x_forwarded_for=address),
                                   "window_sliding once the previous window weighs less")
    # 4 x (2 - t) / 2 + 1 <= 4 from t = 0.5 s into the window; less the
    # poll's lag in finding the fixed window's boundary.
    assert admitted - reopened >= 0.45


def test_a_token_bucket_admits_a_burst_then_refills(rls: RlsStack) -> None:
    """token_bucket: 2 a second, holding 6. A quiet client gets 6 at once
    (a fixed window of 2 a second would admit 2), the 7th is refused with a
    reset of a second at most, and the bucket admits one more half a second
    after the burst began."""
    address = "50.0.3.1"
    started = time.monotonic()
    replies = [rls.get("/token-bucket/", x_forwarded_for=address) for _ in range(7)]
    assert [reply.status for reply in replies] == [200] * 6 + [429]
    assert time.monotonic() - started < 0.5, "the burst took longer than one token's refill"
    assert_refused(replies[6])
    _, _, reset = limit_headers(replies[6])
    assert reset is not None and 1 <= int(reset) <= 1

    admitted = poll_until_admitted(lambda: rls.get("/token-bucket/", x_forwarded_for=address),
                                   "token_bucket after a refill")
    assert admitted - started >= 0.45


# --------------------------------------------------------------------------
# Health
# --------------------------------------------------------------------------


def test_health_answers_as_envoyproxy_ratelimit(rls: RlsStack) -> None:
    """GET /healthcheck is 200 OK, and grpc.health.v1's Check for the
    service ratelimit is SERVING, on the port Envoy asks."""
    connection = http.client.HTTPConnection(LOOPBACK, rls.sluice_port, timeout=2.0)
    try:
        connection.request("GET", "/healthcheck")
        response = connection.getresponse()
        assert (response.status, response.read().strip()) == (200, b"OK")
    finally:
        connection.close()

    with grpc.insecure_channel(f"{LOOPBACK}:{rls.sluice_grpc_port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=HealthCheckRequest.SerializeToString,
                                    response_deserializer=HealthCheckResponse.FromString)
        answer = check(HealthCheckRequest(service="ratelimit"), timeout=5.0)
    assert answer.status == SERVING
