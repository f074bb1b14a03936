"""CrowdSec, both ways: the decisions of a CrowdSec Local API (LAPI)
applied as a bouncer, and Sluice's own bans sent back to it as alerts.

**The bouncer.** ``CrowdSecBouncer`` reads the LAPI's decision stream
(``GET /v1/decisions/stream``, the bouncer's key in ``X-Api-Key``): the
whole list once (``startup=true``), then what is new and what was deleted
every ``poll`` seconds. Decisions of scope ``Ip`` and ``Range`` (IPv4 and
IPv6) of type ``ban`` and ``captcha`` are kept, each until its
``duration`` ends on the engine's clock; anything else is counted as
ignored, by reason. They are held apart from the administrator's network
bans (``sidecar.networkbans``): an administrator lifts their own bans,
CrowdSec's end when the stream deletes them. The stream is fetched and
parsed in a thread of its own, which builds a ``DecisionTable`` and swaps
it in with one assignment: the engine's lookup (one mask and one dict
lookup per prefix length in use) never waits for it. When the LAPI does
not answer, or answers something that is not a stream, the last table
stays, the failure is counted and logged at most once a minute, and the
next poll asks for the whole list again (a stream that failed half-way
cannot be trusted to continue where it stopped).

The stream's deltas are kept by the LAPI per bouncer key: processes that
share one key would each see only part of them. Several workers of one
``sluice serve`` therefore ask for the whole list at every poll
(``whole_list``); several nodes should each have a key of their own.

**The alerts.** ``AlertPusher`` sends the bans Sluice issues (a rule's
``ban``, an escalation, a challenge's auto-ban) to ``POST /v1/alerts``
as a machine (``POST /v1/watchers/login`` gives a token), in batches, from
a bounded queue, in a thread of its own: a check never waits for it. Its
decisions name their scenario ``sluice/NODE/RULE``; this node's bouncer
ignores those it reads back in the stream (they are its own bans already),
other nodes apply them.

Neither logs a key, a password or a token.
"""

from __future__ import annotations

import collections
import datetime
import ipaddress
import json
import logging
import math
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sidecar import version
from sidecar.clientip import ClientAddress, IPNetwork, NetworkTable
from sidecar.identity import shown_url
from sidecar.ratelog import RateLimitedLog
from sidecar.state import BanRecord

log = logging.getLogger("sluice")

# The types of decision Sluice applies, strongest first.
BAN, CAPTCHA = "ban", "captcha"
# The LAPI's scopes Sluice reads (compared in lower case, as the LAPI does).
SCOPES = ("ip", "range")
# Why a decision of the stream was not applied (sluice_crowdsec_decisions_ignored_total).
IGNORED = ("scope", "type", "invalid", "expired", "own", "over_max")
# The result of one poll (sluice_crowdsec_polls_total): answered, not
# reachable or an HTTP error, the key refused (401/403), not a stream.
POLL_RESULTS = ("succeeded", "failed", "refused", "garbage")
# What a batch of alerts came to (sluice_crowdsec_alerts_total), per ban.
ALERT_RESULTS = ("sent", "failed", "dropped")
# A stream's body is read up to this many bytes per decision the table
# may hold (a decision is about 200 bytes of JSON), plus a margin.
BYTES_PER_DECISION = 512
STREAM_MARGIN_BYTES = 1 << 20
# Alerts per request to the LAPI.
ALERT_BATCH = 100
# NAME/VERSION: the LAPI names a bouncer's type and version from it, and
# refuses a machine's login whose user agent has no version.
USER_AGENT_NAME = "crowdsec-sluice-bouncer"
# A decision's duration, as Go writes one: "59m59.09s", "-5.1ms", "4h0m0s".
_GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# Longer durations are taken as this (about 100 years): CrowdSec writes
# no longer ones, and a float of any size stays finite.
MAX_DURATION = 100 * 365 * 86400.0


def parse_go_duration(text: object) -> float | None:
    """Seconds of a Go duration text (negative for one that ended), or None
    for anything else."""
    if not isinstance(text, str) or not 0 < len(text) <= 64:
        return None
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-") if text[0] in "+-" else text
    if body == "0":
        return 0.0
    seconds, position = 0.0, 0
    for part in _GO_DURATION_PART.finditer(body):
        if part.start() != position:
            return None
        seconds += float(part.group(1)) * _GO_UNITS[part.group(2)]
        position = part.end()
    if position == 0 or position != len(body):
        return None
    return sign * min(seconds, MAX_DURATION)


@dataclass(frozen=True, slots=True)
class CrowdSecDecision:
    """One decision of the LAPI that Sluice applies."""

    id: int
    kind: str  # BAN or CAPTCHA (a captcha taken as a ban is BAN)
    network: IPNetwork  # an address is its /32 or /128
    scenario: str
    origin: str
    expires: float  # on the engine's clock

    @property
    def value(self) -> str:
        """The address or range, as shown to people."""
        network = self.network
        return str(network.network_address) if network.prefixlen == network.max_prefixlen else str(network)


class DecisionTable:
    """The decisions in force, looked up for every request's address; never
    changed once made (the bouncer makes a new one). Of several decisions
    on one network, a ban is kept before a captcha, then the longest."""

    __slots__ = ("_table", "counts", "decisions")

    def __init__(self, decisions: Iterable[CrowdSecDecision] = ()) -> None:
        strongest: dict[IPNetwork, CrowdSecDecision] = {}
        for decision in decisions:
            held = strongest.get(decision.network)
            if held is None or (decision.kind == BAN, decision.expires) > (held.kind == BAN, held.expires):
                strongest[decision.network] = decision
        self.decisions = tuple(strongest.values())
        self._table: NetworkTable[CrowdSecDecision] = NetworkTable(strongest.items())
        counts = collections.Counter(decision.kind for decision in self.decisions)
        self.counts = {BAN: counts[BAN], CAPTCHA: counts[CAPTCHA]}

    def __len__(self) -> int:
        return len(self.decisions)

    def find_client(self, client: ClientAddress, now: float) -> CrowdSecDecision | None:
        """The decision in force on the client's address, if any: a ban
        before a captcha, then the narrowest network."""
        numeric = client.numeric
        if numeric is None:
            return None
        version, value = numeric
        found: CrowdSecDecision | None = None
        for mask, decisions in self._table.levels[version]:
            decision = decisions.get(value & mask)
            if decision is not None and now < decision.expires:
                if decision.kind == BAN:
                    return decision
                found = found or decision
        return found

    def matching(self, network: IPNetwork, now: float) -> list[CrowdSecDecision]:
        """The decisions in force that hold ``network`` or that it holds (the admin's lookup)."""
        return [decision for decision in self.decisions if now < decision.expires and decision.network.version
                == network.version and (network.subnet_of(decision.network)  # type: ignore[arg-type]
                                        or decision.network.subnet_of(network))]  # type: ignore[arg-type]


EMPTY_TABLE = DecisionTable()


@dataclass(slots=True)
class StreamChanges:
    """One answer of the stream: decisions to apply, ids to delete, and
    how many of its decisions were ignored, by reason."""

    new: list[CrowdSecDecision]
    deleted: list[int]
    ignored: collections.Counter[str]


def parse_stream(body: bytes, now: float, captcha: str, own_scenarios: str = "") -> StreamChanges:
    """The stream's answer ``body`` read at ``now`` (the engine's clock);
    ValueError when it is not a stream (not JSON, not an object, ``new`` or
    ``deleted`` neither a list nor null). A decision that is malformed in
    any way is ignored and counted, never raised. ``captcha`` says what a
    captcha decision becomes (``challenge``, ``ban``, ``ignore``);
    decisions whose scenario starts with ``own_scenarios`` are ignored."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc.__class__.__name__})") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    lists = []
    for name in ("new", "deleted"):
        entries = document.get(name)
        if entries is not None and not isinstance(entries, list):
            raise ValueError(f"{name!r} is not a list")
        lists.append(entries or [])
    changes = StreamChanges([], [], collections.Counter())
    for entry in lists[0]:
        decision, why = _decision(entry, now, captcha, own_scenarios)
        if decision is not None:
            changes.new.append(decision)
        else:
            changes.ignored[why] += 1
    for entry in lists[1]:
        identifier = entry.get("id") if isinstance(entry, dict) else None
        if type(identifier) is int:
            changes.deleted.append(identifier)
    return changes


def _decision(entry: object, now: float, captcha: str, own_scenarios: str) -> tuple[CrowdSecDecision | None, str]:
    """A stream entry as a decision, or None and why it is ignored."""
    if not isinstance(entry, dict):
        return None, "invalid"
    identifier, scope, kind, value = entry.get("id"), entry.get("scope"), entry.get("type"), entry.get("value")
    scenario, origin = entry.get("scenario", ""), entry.get("origin", "")
    if type(identifier) is not int or not all(isinstance(text, str) for text in (scope, kind, value, scenario, origin)):
        return None, "invalid"
    assert isinstance(scope, str) and isinstance(kind, str) and isinstance(value, str)
    if scope.lower() not in SCOPES:
        return None, "scope"
    kind = kind.lower()
    if kind == CAPTCHA and captcha != "challenge":
        if captcha == "ignore":
            return None, "type"
        kind = BAN
    if kind not in (BAN, CAPTCHA):
        return None, "type"
    if own_scenarios and scenario.startswith(own_scenarios):
        return None, "own"
    seconds = parse_go_duration(entry.get("duration"))
    network = _network(value)
    if seconds is None or network is None:
        return None, "invalid"
    if seconds <= 0:
        return None, "expired"
    return CrowdSecDecision(identifier, kind, network, scenario[:200], origin[:100], now + seconds), ""


def _network(value: str) -> IPNetwork | None:
    """An address or a range of the stream, as a network; None for
    anything else, and for the whole address space."""
    if not 0 < len(value) <= 100:
        return None
    try:
        network = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        return None
    if network.prefixlen == 0:
        return None
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped is not None \
            and network.prefixlen >= 96:
        # ::ffff:a.b.c.d is the IPv4 address a.b.c.d, as clients are resolved.
        return ipaddress.ip_network(f"{network.network_address.ipv4_mapped}/{network.prefixlen - 96}")
    return network


class LapiClient:
    """Requests to the LAPI: JSON over HTTP(S), with a timeout, never
    through a proxy from the environment (the LAPI is the node's own)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.user_agent = f"{USER_AGENT_NAME}/v{version()}"

    def request(self, path: str, headers: Mapping[str, str], body: Any = None, limit: int = 1 << 20) -> bytes:
        """The answer's body (``limit`` bytes at most: ValueError beyond);
        urllib.error.HTTPError for a status of 400 or more, OSError when
        the LAPI cannot be reached."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET",
                                         headers={"User-Agent": self.user_agent, "Accept": "application/json",
                                                  **({"Content-Type": "application/json"} if data else {}),
                                                  **headers})
        with self._opener.open(request, timeout=self.timeout) as answer:
            read: bytes = answer.read(limit + 1)
        if len(read) > limit:
            raise ValueError(f"an answer over {limit} bytes")
        return read


class CrowdSecBouncer:
    """The LAPI's decisions for one ruleset (see the module's docstring).
    Made inert when the rules load; ``start`` polls in a thread until
    ``close``. ``table`` is what the engine looks clients up in."""

    def __init__(self, url: str, key: str | None, poll: float, timeout: float, captcha: str,
                 max_decisions: int, node: str) -> None:
        self.url = url
        self._key = key  # None: the environment variable was not set (said at load)
        self.poll_seconds = poll
        self.captcha = captcha
        self.max_decisions = max_decisions
        self.own_scenarios = f"sluice/{node}/"
        self.client = LapiClient(url, timeout)
        self.table = EMPTY_TABLE
        self.clock: Callable[[], float] = lambda: 0.0
        self.polls: collections.Counter[str] = collections.Counter(dict.fromkeys(POLL_RESULTS, 0))
        self.ignored: collections.Counter[str] = collections.Counter(dict.fromkeys(IGNORED, 0))
        # Several processes share the key: ask for the whole list every time.
        self.whole_list = False
        self._decisions: dict[int, CrowdSecDecision] = {}
        self._startup = True  # the next poll asks for the whole list
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = RateLimitedLog(log, 60)

    @property
    def same_source(self) -> tuple[str, str | None, str]:
        return self.url, self._key, self.captcha

    def start(self, clock: Callable[[], float], polls: collections.Counter[str],
              ignored: collections.Counter[str], whole_list: bool = False) -> None:
        """Read time from ``clock``, count into the engine's counters, and
        poll now and every ``poll`` seconds in a thread of its own."""
        for name, count in self.polls.items():
            polls[name] += count
        for name, count in self.ignored.items():
            ignored[name] += count
        self.clock, self.polls, self.ignored, self.whole_list = clock, polls, ignored, whole_list
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep_polling, name="sluice-crowdsec", daemon=True)
            self._thread.start()

    def follow(self, old: CrowdSecBouncer) -> None:
        """After a reload: the old bouncer's decisions serve until this
        one's first poll, when they are of the same LAPI, key and captcha
        setting."""
        if self.same_source == old.same_source:
            self.table = old.table

    def close(self) -> None:
        self._stop.set()

    def _keep_polling(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_seconds)

    def poll(self) -> str:
        """Ask the stream once and apply its answer; on any failure keep
        the table there is. The result, as counted."""
        startup = self._startup or self.whole_list
        result = self._poll(startup)
        self.polls[result] += 1
        if result != "succeeded":
            self._startup = True
        return result

    def _poll(self, startup: bool) -> str:
        if self._key is None:
            self._log.warning("crowdsec: no bouncer key (crowdsec.key_env is not set); no decisions are read")
            return "refused"
        try:
            body = self.client.request(f"/v1/decisions/stream?startup={'true' if startup else 'false'}"
                                       "&scopes=ip,range", {"X-Api-Key": self._key},
                                       limit=self.max_decisions * BYTES_PER_DECISION + STREAM_MARGIN_BYTES)
            changes = parse_stream(body, self.clock(), self.captcha, self.own_scenarios)
        except urllib.error.HTTPError as exc:
            refused = exc.code in (401, 403)
            self._failed("refused the bouncer key" if refused else f"answered HTTP {exc.code}")
            return "refused" if refused else "failed"
        except ValueError as exc:
            self._failed(f"answered something that is not a decision stream ({exc})")
            return "garbage"
        except OSError as exc:
            self._failed(f"did not answer ({exc.__class__.__name__}: {exc})")
            return "failed"
        self._apply(changes, startup)
        return "succeeded"

    def _failed(self, what: str) -> None:
        self._log.warning("crowdsec: the Local API at %s %s; keeping its last %d decisions, asking again "
                          "every %gs (reported once a minute)", shown_url(self.url), what, len(self.table),
                          self.poll_seconds)

    def _apply(self, changes: StreamChanges, startup: bool) -> None:
        """The stream's changes applied to the decisions held, and a new
        table swapped in."""
        now = self.clock()
        decisions = {} if startup else {key: decision for key, decision in self._decisions.items()
                                        if now < decision.expires}
        for identifier in changes.deleted:
            decisions.pop(identifier, None)
        for reason, count in changes.ignored.items():
            self.ignored[reason] += count
        over = 0
        for decision in changes.new:
            if decision.id not in decisions and len(decisions) >= self.max_decisions:
                over += 1
                continue
            decisions[decision.id] = decision
        if over:
            self.ignored["over_max"] += over
            self._log.warning("crowdsec: %d decisions over crowdsec.max_decisions (%d) were not applied",
                              over, self.max_decisions)
        self._decisions = decisions
        self.table = DecisionTable(decisions.values())
        self._startup = False


# -- alerts -------------------------------------------------------------------------


def _timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def alert_of(ban: BanRecord, remaining: float, node: str) -> dict[str, Any]:
    """The LAPI alert (``POST /v1/alerts``, one list item) of a ban Sluice
    issued to a client key: an address (scope ``Ip``) or its network (an
    IPv6 /64 by default: scope ``Range``), for the ``remaining`` seconds."""
    scope = "Range" if "/" in ban.address else "Ip"
    scenario = f"sluice/{node}/{ban.rule_id or 'admin'}"
    duration = f"{max(1, math.ceil(remaining))}s"
    started = _timestamp(ban.started_wall)
    source: dict[str, Any] = {"scope": scope, "value": ban.address}
    source["range" if scope == "Range" else "ip"] = ban.address
    return {"scenario": scenario, "scenario_hash": "", "scenario_version": "",
            "message": f"Sluice node {node}: rule {ban.rule_id or '(admin)'} banned {ban.address} for {duration}",
            "events_count": 1, "events": [], "start_at": started, "stop_at": started, "capacity": 0,
            "leakspeed": "0", "simulated": False, "remediation": True, "source": source,
            "decisions": [{"origin": "sluice", "type": "ban", "scope": scope, "value": ban.address,
                           "duration": duration, "scenario": scenario, "simulated": False}]}


class AlertPusher:
    """Sends bans to the LAPI as alerts (see the module's docstring):
    ``offer`` is called on the request path and only appends to a bounded
    queue; a thread sends batches, logged in as a machine."""

    def __init__(self, url: str, machine_id: str, password: str | None, timeout: float, queue: int,
                 node: str, retry: float = 10.0) -> None:
        self.url = url
        self.machine_id = machine_id
        self._password = password  # None: the environment variable was not set (said at load)
        self.node = node
        self.capacity = queue
        self.retry = retry
        self.client = LapiClient(url, timeout)
        self.results: collections.Counter[str] = collections.Counter(dict.fromkeys(ALERT_RESULTS, 0))
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._token: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = RateLimitedLog(log, 60)

    def start(self, results: collections.Counter[str]) -> None:
        for name, count in self.results.items():
            results[name] += count
        self.results = results
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep_sending, name="sluice-crowdsec-alerts", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop after the batch being sent (what waits is not sent)."""
        self._stop.set()
        self._wake.set()

    def offer(self, ban: BanRecord, remaining: float) -> None:
        """Queue the alert of a ban just issued; dropped (and counted) when
        the queue is full. Never waits."""
        if len(self._queue) >= self.capacity:
            self.results["dropped"] += 1
            return
        self._queue.append(alert_of(ban, remaining, self.node))
        self._wake.set()

    def _keep_sending(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            while self._queue and not self._stop.is_set():
                if not self.send_batch():
                    self._stop.wait(self.retry)  # the LAPI is down: the batch is sent again later

    def send_batch(self) -> bool:
        """Send the oldest alerts waiting (``ALERT_BATCH`` at most); they
        leave the queue once the LAPI took them. False when it did not."""
        batch = [self._queue[index] for index in range(min(ALERT_BATCH, len(self._queue)))]
        if not batch:
            return True
        try:
            try:
                self._send(batch)
            except urllib.error.HTTPError as exc:
                if exc.code != 401:
                    raise
                self._token = None  # expired: log in again, once
                self._send(batch)
        except (OSError, ValueError) as exc:
            self.results["failed"] += len(batch)
            self._log.warning("crowdsec: alerts to the Local API at %s failed (%s); %d bans wait to be sent "
                              "(reported once a minute)", shown_url(self.url), _reason(exc), len(self._queue))
            return False
        for _ in batch:
            self._queue.popleft()
        self.results["sent"] += len(batch)
        return True

    def _send(self, batch: list[dict[str, Any]]) -> None:
        if self._token is None:
            self._token = self._login()
        self.client.request("/v1/alerts", {"Authorization": f"Bearer {self._token}"}, batch)

    def _login(self) -> str:
        if self._password is None:
            raise ValueError("no machine password (crowdsec.push_bans.password_env is not set)")
        answer = json.loads(self.client.request("/v1/watchers/login", {}, {
            "machine_id": self.machine_id, "password": self._password, "scenarios": []}))
        token = answer.get("token") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise ValueError("the login's answer has no token")
        return token

    @property
    def waiting(self) -> int:
        return len(self._queue)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}" + (": the machine's login was refused" if exc.code in (401, 403) else "")
    return f"{exc.__class__.__name__}: {exc}"
