"""Human verification for ``action: challenge``.

A key in the penalty of a challenge rule gets a page with a *challenge*: a
string signed by Sluice naming the rule, when it was issued, the proof-of-work
difficulty D and where to go back to. The browser finds a nonce such that
``SHA-256(challenge + nonce)`` starts with D zero bits and posts both back;
Sluice checks the signature, the age, the client and the work, and answers
with a *credential* cookie for that rule. No state is kept for either: both
carry what they need and are signed, so any Sluice process holding the same
secret accepts them, and memory stays flat however many challenges are out.

Bindings. The challenge's signature covers the client address key and the
TLS fingerprint the proxy reported (neither is written in the challenge):
solving a challenge issued to another address is refused. The credential is
``EXPIRES.SIGNATURE`` over the rule id, the client key, the fingerprint and
the expiry: it passes only that rule, from that address (the same key the
rules count by, so an IPv6 /64), over a TLS connection with that fingerprint.

Both use keys derived from the secret with a label of their own, so neither
can stand in for the other or for a pending-counts token (``sidecar.pending``).
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from sidecar.signing import Signer, b64decode, b64encode

# A challenge must be solved and posted within this many seconds.
CHALLENGE_MAX_AGE = 300.0
# How far a clock may step back between issue and use (wall clock).
CLOCK_SLACK = 60.0
# Longer original URIs are not carried: the challenge travels in a header
# between Sluice and nginx, whose buffer for it is one page (4 KB). A client
# then goes back to the path alone, or to "/".
MAX_RETURN_URI = 1024
MAX_CHALLENGE_LENGTH = 2048
COOKIE_PREFIX = "sluice_pass_"
# Where the page posts its solution: a path on the protected site that the
# shipped nginx and Envoy configurations send to Sluice's CHALLENGE_PATH.
SOLUTION_PATH = "/.sluice/challenge"
FINGERPRINT_HEADER = "x-sluice-tls-fingerprint"


def cookie_name(rule_id: str) -> str:
    """One credential cookie per rule: rule ids are valid cookie-name text."""
    return COOKIE_PREFIX + rule_id


def leading_zero_bits(digest: bytes) -> int:
    bits = 0
    for byte in digest:
        if byte:
            return bits + 8 - byte.bit_length()
        bits += 8
    return bits


def solves(challenge: str, nonce: str, difficulty: int) -> bool:
    """Does ``nonce`` (decimal digits, as the page sends it) do the work?"""
    if not (0 < len(nonce) <= 20 and nonce.isascii() and nonce.isdigit()):
        return False
    digest = hashlib.sha256((challenge + nonce).encode("ascii")).digest()
    return leading_zero_bits(digest) >= difficulty


def solve(challenge: str, difficulty: int, tries: int = 1 << 28) -> str:
    """What the page's JavaScript does, for tests and scripted clients."""
    for nonce in range(tries):
        if solves(challenge, str(nonce), difficulty):
            return str(nonce)
    raise ValueError(f"no nonce below {tries} gives {difficulty} zero bits")


def safe_return_uri(uri: str) -> str:
    """The original request's URI as a same-site path to redirect to.

    Leading slashes and backslashes are folded into one slash, so that
    ``//evil.example/`` cannot become a redirect to another site, and
    anything but printable ASCII is percent-encoded.
    """
    path = "/" + uri.lstrip("/\\")
    path = quote(path, safe="/?&=%:@!$'()*+,;~#-._[]")
    if len(path) > MAX_RETURN_URI:
        path = path.partition("?")[0]
    return path if len(path) <= MAX_RETURN_URI else "/"


@dataclass(frozen=True, slots=True)
class IssuedChallenge:
    text: str
    difficulty: int


@dataclass(frozen=True, slots=True)
class Ticket:
    """A genuine challenge's contents."""

    rule_id: str
    issued: float
    difficulty: int
    location: str  # where the client goes back to (a same-site path)


class Challenges:
    """Issues and checks challenges and credentials with one secret."""

    def __init__(self, secret: bytes, wall_clock: Callable[[], float] = time.time) -> None:
        self._challenges = Signer(secret, b"sluice challenge")
        self._credentials = Signer(secret, b"sluice challenge credential", length=32)
        self._wall_clock = wall_clock

    # -- challenges -------------------------------------------------------

    @staticmethod
    def _challenge_binding(encoded: str, client_key: str, fingerprint: str) -> bytes:
        return json.dumps([encoded, client_key, fingerprint], separators=(",", ":")).encode("utf-8")

    def issue(self, rule_id: str, client_key: str, fingerprint: str, uri: str,
              difficulty: int) -> IssuedChallenge:
        payload = [rule_id, int(self._wall_clock()), difficulty, safe_return_uri(uri),
                   os.urandom(6).hex()]
        encoded = b64encode(json.dumps(payload, separators=(",", ":")).encode("ascii"))
        signature = self._challenges.sign(self._challenge_binding(encoded, client_key, fingerprint))
        return IssuedChallenge(f"{encoded}.{signature}", difficulty)

    def open(self, challenge: str, client_key: str, fingerprint: str) -> Ticket | None:
        """The ticket of a challenge signed for this client; None for anything
        else. Whether it is fresh and solved is ``verify``'s business."""
        encoded, _, signature = challenge.partition(".")
        if not encoded or not signature or len(challenge) > MAX_CHALLENGE_LENGTH:
            return None
        try:
            if not self._challenges.verifies(self._challenge_binding(encoded, client_key, fingerprint),
                                             signature):
                return None
            rule_id, issued, difficulty, location, _ = json.loads(b64decode(encoded))
        except (ValueError, UnicodeError, binascii.Error, TypeError):
            return None
        return Ticket(rule_id, float(issued), int(difficulty), location)

    def verify(self, challenge: str, nonce: str, client_key: str, fingerprint: str) -> tuple[Ticket | None, str]:
        """(ticket, "") for a genuine, fresh, solved challenge of this client;
        else (ticket or None, why not)."""
        ticket = self.open(challenge, client_key, fingerprint)
        if ticket is None:
            return None, "not a challenge issued to this client"
        age = self._wall_clock() - ticket.issued
        if not -CLOCK_SLACK <= age <= CHALLENGE_MAX_AGE:
            return ticket, "the challenge has expired"
        if not solves(challenge, nonce, ticket.difficulty):
            return ticket, "the nonce does not solve the challenge"
        return ticket, ""

    # -- credentials ------------------------------------------------------

    @staticmethod
    def _credential_binding(rule_id: str, client_key: str, fingerprint: str, expires: int) -> bytes:
        return json.dumps([rule_id, client_key, fingerprint, expires], separators=(",", ":")).encode("utf-8")

    def credential(self, rule_id: str, client_key: str, fingerprint: str, ttl: float) -> str:
        expires = int(self._wall_clock() + ttl)
        signature = self._credentials.sign(self._credential_binding(rule_id, client_key, fingerprint, expires))
        return f"{expires}.{signature}"

    def accepts(self, credential: str, rule_id: str, client_key: str, fingerprint: str) -> bool:
        expires_text, _, signature = credential.partition(".")
        if not (expires_text.isascii() and expires_text.isdigit() and len(expires_text) <= 12):
            return False
        expires = int(expires_text)
        if expires <= self._wall_clock():
            return False
        return self._credentials.verifies(self._credential_binding(rule_id, client_key, fingerprint, expires),
                                          signature)
