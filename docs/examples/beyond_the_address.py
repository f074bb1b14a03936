"""The two cases of the "Beyond the address" page, as logs and rules files
that `sluice replay` reads: a campus behind one NAT, and a scraper
rotating through its hosting provider's addresses.

``python docs/examples/beyond_the_address.py DIR`` writes into DIR:

- ``jwks.json`` and the campus log ``campus.log`` (JSON lines that kept
  ``$http_authorization``): 200 students behind 198.51.100.10, each with
  a token, 40 requests each over ten minutes, and one of them scripting
  600 requests a minute;
- ``campus-by-address.yaml`` and ``campus-by-student.yaml``;
- ``asn.mmdb`` and the proxy-pool log ``pool.log``: a scraper sending 20
  requests a second from a new address of 203.0.113.0/24 (one autonomous
  system) each time, among 50 ordinary clients of other networks;
- ``pool-by-address.yaml`` and ``pool-by-network.yaml``.

tests/unit/test_beyond_the_address.py replays them and holds the page's
figures to what replay reports. Loopback and files only; nothing is sent.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.geodb import write_asn_database  # noqa: E402
from tests.jwks import Issuer  # noqa: E402

START = 1_709_287_200.0  # 2024-03-01 10:00 UTC
NAT = "198.51.100.10"

CAMPUS_BY_ADDRESS = """\
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 300, per: 1m}
    action: block
"""

CAMPUS_BY_STUDENT = """\
jwt:
  keys: {file: jwks.json}
  algorithms: [ES256]
rules:
  - id: per-student
    key: ["jwt:sub"]
    limit: {requests: 120, per: 1m}
    action: block
  - id: anonymous
    match: {not: {jwt: {claim: sub, present: true}}}
    key: [ip]
    limit: {requests: 300, per: 1m}
    action: challenge
"""

POOL_BY_ADDRESS = """\
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 60, per: 1m}
    action: block
"""

POOL_BY_NETWORK = """\
geoip: {asn: asn.mmdb}
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 60, per: 1m}
    action: block
  - id: per-network
    key: [asn]
    limit: {requests: 600, per: 1m}
    action: block
"""


def line(address: str, when: float, path: str, token: str | None = None) -> dict[str, str]:
    entry = {"remote_addr": address, "msec": f"{when:.3f}", "request": f"GET {path} HTTP/1.1", "status": "200",
             "host": "portal.example.edu"}
    if token is not None:
        entry["http_authorization"] = f"Bearer {token}"
    return entry


def write_log(path: Path, entries: list[dict[str, str]]) -> None:
    entries.sort(key=lambda entry: float(entry["msec"]))
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def campus(directory: Path, issuer: Issuer, rng: random.Random) -> None:
    (directory / "jwks.json").write_text(json.dumps(issuer.jwks(("ES256",))))
    entries = []
    for student in range(200):
        token = issuer.token({"sub": f"student-{student}", "exp": START + 86_400}, "ES256", lifetime=None)
        for _ in range(40):
            entries.append(line(NAT, START + rng.uniform(0, 600), "/api/courses", token))
    scripted = issuer.token({"sub": "student-scripted", "exp": START + 86_400}, "ES256", lifetime=None)
    entries += [line(NAT, START + 120 + n * 0.1, "/api/grades", scripted) for n in range(1200)]
    write_log(directory / "campus.log", entries)
    (directory / "campus-by-address.yaml").write_text(CAMPUS_BY_ADDRESS)
    (directory / "campus-by-student.yaml").write_text(CAMPUS_BY_STUDENT)


def pool(directory: Path, rng: random.Random) -> None:
    write_asn_database(directory / "asn.mmdb", {"203.0.113.0/24": (64500, "Example Hosting", "NL"),
                                               "192.0.2.0/24": (64496, "Example Broadband", "DE")})
    entries = [line(f"203.0.113.{n % 254 + 1}", START + n * 0.05, f"/products?page={n}") for n in range(6000)]
    for client in range(50):
        entries += [line(f"192.0.2.{client + 1}", START + rng.uniform(0, 300), "/products") for _ in range(30)]
    write_log(directory / "pool.log", entries)
    (directory / "pool-by-address.yaml").write_text(POOL_BY_ADDRESS)
    (directory / "pool-by-network.yaml").write_text(POOL_BY_NETWORK)


def write_examples(directory: Path) -> None:
    rng = random.Random(2024)
    campus(directory, Issuer(), rng)
    pool(directory, rng)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    target.mkdir(parents=True, exist_ok=True)
    write_examples(target)
    print(f"wrote the examples into {target}")
