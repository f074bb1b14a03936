"""``sluice admin``: the admin API of a running ``sluice serve``, from a
terminal or a script (``--json``).

Standard library only: the commands talk HTTP (or HTTP over the Unix
socket of ``sluice serve --uds``) with ``http.client``. Every failure —
no Sluice there, a refused token, a rule or ban that does not exist, a
value Sluice refuses — is one line on stderr and exit status 1.
"""

from __future__ import annotations

import functools
import http.client
import json
import re
import socket
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import click

from sidecar.plurals import plural

DEFAULT_URL = "http://127.0.0.1:8181"
TIMEOUT = 10.0
# A table cell shows at most this much of a value (--json shows it whole).
CELL_CHARS = 60


class AdminError(Exception):
    """A call that did not succeed: the one line to print."""


class UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (``unix:/run/sluice.sock``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class AdminClient:
    """Calls ``/v1/admin/...`` of the Sluice at ``url`` with the bearer
    token in ``token_file`` (none: a loopback Sluice without a token)."""

    def __init__(self, url: str, token_file: str | None) -> None:
        self.url = url
        self.token_file = token_file

    def call(self, method: str, path: str, query: Sequence[tuple[str, str]] = (), body: Any = None) -> Any:
        """The JSON answer (None for an empty one); AdminError otherwise."""
        target = f"/v1/admin/{path}" + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json"}
        token = self._token()
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        connection = self._connection()
        try:
            connection.request(method, target, body=data, headers=headers)
            response = connection.getresponse()
            status, text = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise AdminError(f"cannot reach Sluice at {self.url} ({_reason(exc)}): is `sluice serve` "
                             "running there? (--url, SLUICE_ADMIN_URL)") from None
        finally:
            connection.close()
        answer = _json(text)
        if status >= 400:
            raise AdminError(self._refusal(status, answer))
        if isinstance(answer, str):
            raise AdminError(f"{self.url} answered {status} but not with JSON: is it sluice serve? "
                             "(--url, SLUICE_ADMIN_URL)")
        return answer

    def _token(self) -> str | None:
        if self.token_file is None:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise AdminError(f"cannot read the token file {self.token_file}: {_reason(exc)}") from None
        if not token:
            raise AdminError(f"the token file {self.token_file} is empty")
        return token

    def _connection(self) -> http.client.HTTPConnection:
        try:
            parts = urlsplit(self.url)
        except ValueError as exc:
            raise AdminError(f"--url: {exc} in {self.url!r}") from None
        if parts.scheme == "unix":
            return UnixConnection(parts.path, TIMEOUT)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AdminError(f"--url: expected http://HOST:PORT, https://HOST:PORT or unix:/PATH, got {self.url!r}")
        try:
            port = parts.port
        except ValueError:
            raise AdminError(f"--url: the port of {self.url!r} is not a number from 1 to 65535") from None
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.hostname, port, timeout=TIMEOUT,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(parts.hostname, port, timeout=TIMEOUT)

    def _refusal(self, status: int, answer: Any) -> str:
        detail = _detail(answer)
        if status == 401:
            if self.token_file is None:
                return "the admin API needs its bearer token: give --token-file (or SLUICE_ADMIN_TOKEN_FILE)"
            return f"the admin API refused the token in {self.token_file} (401)"
        if status == 404 and detail == "Not Found":
            return (f"no admin API at {self.url} (404): is it sluice serve, with --admin-token-file or on a "
                    "loopback address?")
        return f"{detail} ({status})"


def _json(text: bytes) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text.decode("utf-8", "replace")[:200]


def _detail(answer: Any) -> str:
    """What a refusal says: FastAPI's ``detail`` (a text, or its first
    validation error), or a reload's errors."""
    if isinstance(answer, dict):
        if "errors" in answer:
            return "; ".join(map(str, answer["errors"]))
        detail = answer.get("detail")
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            where = ".".join(str(part) for part in detail[0].get("loc", ()) if part != "query")
            return f"{where}: {detail[0].get('msg', '')}" if where else str(detail[0].get("msg", ""))
        if detail is not None:
            return str(detail)
    return str(answer)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within {TIMEOUT:g} s"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _cell(value: Any) -> str:
    """A value as a table shows it: printable, and cut when long."""
    if value is None or value == "":
        return "-"
    text = "".join(char if char.isprintable() else f"\\x{ord(char):02x}" for char in str(value))
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned, two spaces apart."""
    cells = [list(headers)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells)


def seconds_text(seconds: float | None) -> str:
    """A time left, as a person reads it: 45s, 12m 5s, 3h 20m, 2d 4h."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s".replace(".0s", "s")
    whole = int(round(seconds))
    for unit, size, smaller, smaller_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if whole >= size:
            rest = (whole % size) // smaller_size
            return f"{whole // size}{unit}" + (f" {rest}{smaller}" if rest else "")
    return f"{whole}s"


def _ban_line(ban: dict[str, Any]) -> str:
    by = "by hand" + (f" ({ban['reason']})" if ban.get("reason") else "") if ban["rule"] == "manual" \
        else f"by rule {ban['rule']}"
    return f"{ban['address']} is banned {by}, {seconds_text(ban['remaining_seconds'])} left"


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def _options(command: Callable[..., None]) -> Callable[..., None]:
    """``--url``, ``--token-file`` and ``--json`` for every command; the
    command gets a client and ``as_json``, and errors become one line."""

    @click.option("--url", default=DEFAULT_URL, envvar="SLUICE_ADMIN_URL", show_envvar=True, show_default=True,
                  help="Where sluice serve answers: http://HOST:PORT, https://HOST:PORT or unix:/PATH (--uds).")
    @click.option("--token-file", type=click.Path(dir_okay=False), envvar="SLUICE_ADMIN_TOKEN_FILE",
                  show_envvar=True, help="The admin API's bearer token (sluice serve --admin-token-file).")
    @click.option("--json", "as_json", is_flag=True, help="Print the API's JSON answer, for scripts.")
    @functools.wraps(command)
    def run(url: str, token_file: str | None, as_json: bool, **arguments: Any) -> None:
        try:
            command(AdminClient(url, token_file), as_json, **arguments)
        except AdminError as exc:
            click.echo(f"error: {exc}", err=True)
            raise SystemExit(1) from None

    return run


def _print_json(answer: Any) -> None:
    click.echo(json.dumps(answer, indent=2, ensure_ascii=False))


@click.group("admin", context_settings={"help_option_names": ["-h", "--help"]})
def admin() -> None:
    """Undo a mistake on a running Sluice: list and lift bans, ban a client
    or a network by hand, list and reset a client's or a rule's counters,
    reload the rules. With the Redis backend every node sees it at once.

    Each command takes --url (SLUICE_ADMIN_URL), --token-file
    (SLUICE_ADMIN_TOKEN_FILE) and --json.
    """


@admin.command()
@_options
def rules(client: AdminClient, as_json: bool) -> None:
    """The rules running now, in order, with their hits and refusals."""
    answer = client.call("GET", "rules")
    if as_json:
        _print_json(answer)
        return
    click.echo(table(["RULE", "ACTION", "LIMIT", "PENALTY", "HITS", "OVER LIMIT"], [
        [rule["id"], rule["action"], rule["limit"], seconds_text(rule["penalty_seconds"]), rule["hits"],
         ", ".join(f"{action} {count}" for action, count in sorted(rule["over_limit"].items()))]
        for rule in answer]))


@admin.command()
@_options
def bans(client: AdminClient, as_json: bool) -> None:
    """The bans in force: of client addresses (earned or by hand), then of networks."""
    answer = client.call("GET", "bans")
    if as_json:
        _print_json(answer)
    elif not answer:
        click.echo("no bans in force")
    else:
        click.echo(table(["ADDRESS", "RULE", "REASON", "NODE", "STARTED", "LEFT"], [
            [ban["address"], ban["rule"], ban["reason"], ban["node"], ban["started"],
             seconds_text(ban["remaining_seconds"])] for ban in answer]))


@admin.command()
@click.argument("address")
@click.option("--for", "duration", required=True, metavar="DURATION",
              help="How long: 90s, 15m, 1h, 1d (1s to 1y), or seconds.")
@click.option("--reason", default="", show_default=False, help="Why, for whoever reads the ban list.")
@_options
def ban(client: AdminClient, as_json: bool, address: str, duration: str, reason: str) -> None:
    """Ban ADDRESS by hand: a client (an IPv6 one by its /64, as rules count
    it) or a network (198.51.100.0/24), refused at every front door."""
    # Seconds go as a number; anything else Sluice reads as a duration.
    seconds: str | float = float(duration) if re.fullmatch(r"\d+(\.\d+)?", duration.strip()) else duration
    answer = client.call("POST", "bans", body={"address": address, "duration": seconds, "reason": reason})
    if as_json:
        _print_json(answer)
        return
    what = "the network " if answer["scope"] == "network" else ""
    click.echo(f"banned {what}{answer['address']} for {seconds_text(answer['duration_seconds'])}"
               + (f": {answer['reason']}" if answer["reason"] else ""))


@admin.command()
@click.argument("address")
@_options
def unban(client: AdminClient, as_json: bool, address: str) -> None:
    """Lift the ban of ADDRESS, earned or by hand, or of a network."""
    client.call("DELETE", "bans", [("address", address)])
    if as_json:
        _print_json({"lifted": address})
    else:
        click.echo(f"lifted the ban of {address}")


def _counter_options(command: Callable[..., None]) -> Callable[..., None]:
    for option in reversed([
        click.option("--ip", help="Every counter of this client address (rules keyed by ip, and session: "
                                  "rules that fell back to the address)."),
        click.option("--rule", help="Every counter of this rule; with --key, one of them."),
        click.option("--key", "keys", multiple=True, metavar="DIMENSION=VALUE",
                     help="One of the rule's dimensions and its value (header:x-api-key=abc, ip=203.0.113.7); "
                          "once per dimension of the rule."),
    ]):
        command = option(command)
    return command


def _selection(ip: str | None, rule: str | None, keys: Sequence[str]) -> list[tuple[str, str]]:
    if ip is None and rule is None:
        raise click.UsageError("give --ip ADDRESS, or --rule RULE (and --key DIMENSION=VALUE for one key)")
    return [*([("ip", ip)] if ip is not None else []), *([("rule", rule)] if rule is not None else []),
            *(("key", key) for key in keys)]


@admin.command()
@_counter_options
@click.option("--limit", default=1000, show_default=True, type=click.IntRange(1, 10_000),
              help="Counters listed at most.")
@_options
def counters(client: AdminClient, as_json: bool, ip: str | None, rule: str | None, keys: tuple[str, ...],
             limit: int) -> None:
    """The counters of a client address or of a rule, as their limits see
    them now: what remains, when it resets, the penalty left."""
    answer = client.call("GET", "counters", [*_selection(ip, rule, keys), ("limit", str(limit))])
    if as_json:
        _print_json(answer)
        return
    if not answer["counters"]:
        click.echo("no counters")
    else:
        click.echo(table(["RULE", "KEY", "LIMIT", "REMAINING", "RESETS IN", "PENALTY LEFT"], [
            [counter["rule"], counter["key"], counter["limit"], counter["remaining"],
             seconds_text(counter["reset_seconds"]),
             seconds_text(counter["penalty_seconds"]) if counter["penalty_seconds"] else "-"]
            for counter in answer["counters"]]))
    if answer["truncated"]:
        click.echo(f"(the first {limit} only: --limit)")
    if answer.get("ban"):
        click.echo(_ban_line(answer["ban"]))


@admin.command()
@_counter_options
@_options
def reset(client: AdminClient, as_json: bool, ip: str | None, rule: str | None, keys: tuple[str, ...]) -> None:
    """Reset the counters of a client address, of a rule, or one key of a
    rule: their counts start again and their penalties end."""
    answer = client.call("DELETE", "counters", _selection(ip, rule, keys))
    if as_json:
        _print_json(answer)
        return
    of = f"of {ip}" if ip is not None else f"of rule {rule}" + (f" ({' '.join(keys)})" if keys else "")
    click.echo(f"reset {plural(answer['reset'], 'counter')} {of}")
    if answer.get("ban"):
        click.echo(_ban_line(answer["ban"]) + f": sluice admin unban {answer['ban']['address']}")


@admin.command()
@_options
def reload(client: AdminClient, as_json: bool) -> None:
    """Read the rules file again (as SIGHUP does); an invalid one is refused
    with its errors and the old rules keep running."""
    answer = client.call("POST", "reload")
    if as_json:
        _print_json(answer)
    else:
        click.echo(f"reloaded: {plural(answer['rules'], 'rule')}")


@admin.group()
def tier() -> None:
    """The tiers of identities (the rules file's tiers: section): list them,
    assign an identity to a tier at run time, remove that assignment. Run-time
    assignments are kept by the state store: with Redis, every node has them."""


@tier.command("list")
@click.option("--limit", default=1000, show_default=True, type=click.IntRange(1, 10_000),
              help="Assignments listed at most.")
@_options
def tier_list(client: AdminClient, as_json: bool, limit: int) -> None:
    """The tiers, and the identities assigned to them: at run time, then by the tiers file."""
    answer = client.call("GET", "tiers", [("limit", str(limit))])
    if as_json:
        _print_json(answer)
        return
    click.echo(f"tiers: {', '.join(answer['names'])} (default {answer['default']}); "
               f"identity: {answer['identity'] or '-'}")
    if not answer["assignments"]:
        click.echo("no identity assigned")
    else:
        click.echo(table(["IDENTITY", "TIER", "FROM"], [
            [assignment["identity"], assignment["tier"], assignment["from"]] for assignment in answer["assignments"]]))
    if answer["truncated"]:
        click.echo(f"(the first {limit} only: --limit)")


@tier.command("set")
@click.argument("identity")
@click.argument("tier_name", metavar="TIER")
@_options
def tier_set(client: AdminClient, as_json: bool, identity: str, tier_name: str) -> None:
    """Assign IDENTITY (the value of tiers.identity: an API key, a subject)
    to TIER at run time, before any assignment of the tiers file."""
    answer = client.call("POST", "tiers", body={"identity": identity, "tier": tier_name})
    if as_json:
        _print_json(answer)
    else:
        click.echo(f"assigned to tier {answer['tier']}")


@tier.command("unset")
@click.argument("identity")
@_options
def tier_unset(client: AdminClient, as_json: bool, identity: str) -> None:
    """Remove the run-time assignment of IDENTITY: the tiers file's, a
    token's claim or the default tier applies again."""
    client.call("DELETE", "tiers", body={"identity": identity})
    if as_json:
        _print_json({"removed": True})
    else:
        click.echo("removed the run-time assignment")
