import asyncio
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar import addresses, cli
from sidecar.config import parse_rules_text
from sidecar.engine import Engine
from sidecar.request import CheckRequest
from sidecar.rules import Ruleset, compile_rules
from sidecar.server import LimitedHttpProtocol


class FakeClock:
    """Monotonic time that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ruleset_from(text: str, base_dir: Path | None = None, shadow: bool = False) -> Ruleset:
    return compile_rules(parse_rules_text(text, "test.yaml", base_dir or Path.cwd()), shadow)


def refused_by(engine: Engine, address: str = "192.0.2.1", headers: dict[str, str] | None = None) -> str:
    """The id of the rule that refused a GET of ``address`` with
    ``headers``, or "allow"."""
    request = CheckRequest("GET", "h", "/", dict(headers or {}), engine.resolve_client(address, None), "r")
    decision = engine.decide_now(request)
    return decision.rule.id if decision.rule is not None and str(decision.outcome) == "deny" else "allow"


class Harness:
    """An engine on a fake clock, and a way to describe requests briefly."""

    def __init__(self, text: str, base_dir: Path | None = None) -> None:
        self.clock = FakeClock()
        self.engine = Engine(ruleset_from(text, base_dir), clock=self.clock)

    def request(self, ip: str = "192.0.2.1", path: str = "/", method: str = "GET",
                host: str = "example.com", headers: dict | None = None,
                forwarded_for: str | None = None) -> CheckRequest:
        client = self.engine.resolve_client(ip, forwarded_for)
        return CheckRequest(method, host, path, dict(headers or {}), client, "req-1")

    def decide_now(self, **kwargs):
        return self.engine.decide_now(self.request(**kwargs))

    def outcomes(self, count: int, **kwargs) -> list[str]:
        return [self.decide_now(**kwargs).outcome for _ in range(count)]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What serve would run uvicorn with (nothing is started): the options,
    and as "app" the settings, with the rules as "ruleset"."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: calls.append({"app": app, **options}))
    monkeypatch.setattr(cli, "service", lambda settings, ruleset=None: {**settings, "ruleset": ruleset})
    return calls


@pytest.fixture
def served(started: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """As ``started``, without trying the addresses serve listens on (a
    port of this machine in use does not matter)."""
    monkeypatch.setattr(addresses, "check_listeners", lambda listeners: None)
    return started


class RecordingTransport(asyncio.Transport):
    """Where Sluice's HTTP protocol writes its answers in a unit test: kept
    in ``written``, the connection open until the protocol closes it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8181), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def connection_to(engine: Engine, loop: asyncio.AbstractEventLoop | None = None,
                  state: ServerState | None = None) -> tuple[LimitedHttpProtocol, RecordingTransport]:
    """Sluice's HTTP protocol on one new connection to an application of
    ``engine``, its answers kept by a RecordingTransport."""
    from sidecar.app import SluiceApp

    config = Config(app=SluiceApp(engine), lifespan="off", log_level="warning", proxy_headers=False)
    config.load()
    protocol = LimitedHttpProtocol(config=config, server_state=state or ServerState(), app_state={},
                                   _loop=loop or asyncio.new_event_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport
