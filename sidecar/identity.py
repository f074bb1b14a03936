"""Who the client is, from a JSON Web Token: the claims that rules key on
(``jwt:CLAIM``) and test (``match: {jwt: ...}``).

A request's token is read once (``JwtReader.read``) from where the rules
file says: ``Authorization: Bearer``, another header, a cookie, or the
payload header of a proxy that verified the token already (Envoy's
``jwt_authn`` ``forward_payload_header``). It is then:

- **verified** against the keys of a JWKS (a file read at load, or a URL
  fetched in the background, refreshed, the last good set kept when a
  fetch fails): its algorithm must be one the file allows and its key's,
  its signature good, and its issuer and audience the file's when it
  names them;
- or, only when the file says the proxy verified it (``verified_by_proxy``),
  read without verifying.

Either way ``exp`` and ``nbf`` are checked against the engine's wall clock
(with the file's leeway), never PyJWT's own, so that tests and replay move
time. What a token gives is cached per token text (a bounded map, emptied
when the keys change), so that a client's token is verified once, not
once per request; a token that expires while cached is found expired on
its next use.

A request without a valid token has no claims: a ``jwt:`` dimension then
counts it under the client's address (as ``session:`` does without its
cookie), and a ``jwt`` condition does not hold. Every token read is
counted by its outcome (``OUTCOMES``) in ``sluice_jwt_tokens_total``.
Nothing here raises into the request: a bad token is an outcome.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import logging
import math
import threading
import time
import types
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jwt

from sidecar.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from sidecar.request import CheckRequest

log = logging.getLogger("sluice")

# Why a request has the claims it has ("valid"), or none.
OUTCOMES = ("valid", "missing", "malformed", "too_long", "algorithm", "unknown_key", "bad_signature",
            "expired", "not_yet_valid", "bad_claims", "no_keys")
# A token's field longer than this is refused unread: no proxy sends one this long
# in a header line, and its verification must not be an attacker's lever.
MAX_TOKEN_LENGTH = 8192
# Tokens whose outcome is remembered, at most: the map is emptied when full.
CACHE_SIZE = 4096
# Algorithms a rules file may allow; each key is used with its own only.
ALGORITHMS = ("HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
              "ES256", "ES384", "ES512", "EdDSA")
# A JWKS fetched from a URL: at most this many bytes.
MAX_JWKS_BYTES = 1 << 20

Claims = Mapping[str, Any]
NO_CLAIMS: Claims = types.MappingProxyType({})


class TokenRead(NamedTuple):
    """What a request's token gave: its claims (empty unless ``outcome``
    is "valid")."""

    outcome: str
    claims: Claims = NO_CLAIMS


MISSING = TokenRead("missing")


class KeySet:
    """A JWKS's usable keys, by key id, each with its algorithm."""

    def __init__(self, keys: list[jwt.PyJWK]) -> None:
        self.keys = keys
        self.by_id: dict[str, list[jwt.PyJWK]] = {}
        for key in keys:
            self.by_id.setdefault(key.key_id or "", []).append(key)

    def __len__(self) -> int:
        return len(self.keys)

    def candidates(self, key_id: str | None, algorithm: str) -> list[jwt.PyJWK]:
        """The keys a token's header may name: by its ``kid``, or without
        one every key of its algorithm."""
        keys = self.by_id.get(key_id, []) if key_id is not None else self.keys
        return [key for key in keys if key.algorithm_name == algorithm]


def parse_jwks(text: str | bytes, allowed: tuple[str, ...] = ALGORITHMS) -> KeySet:
    """A JWKS document's keys; ValueError says why it is unusable. Keys of
    a kind PyJWT cannot use, or for an algorithm the file does not allow,
    are left out; a document left with none is unusable."""
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError('not a JWKS: expected an object with a "keys" list')
    keys: list[jwt.PyJWK] = []
    skipped: list[str] = []
    for index, entry in enumerate(document["keys"]):
        if not isinstance(entry, dict):
            skipped.append(f"keys[{index}] is not an object")
            continue
        if entry.get("use", "sig") != "sig":
            continue  # an encryption key
        try:
            key = jwt.PyJWK(entry)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError, KeyError) as exc:
            skipped.append(f"keys[{index}]: {exc}")
            continue
        if key.algorithm_name in allowed:
            keys.append(key)
        else:
            skipped.append(f"keys[{index}]: algorithm {key.algorithm_name} not in algorithms")
    if not keys:
        raise ValueError("no usable signing key" + (f" ({'; '.join(skipped[:3])})" if skipped else ""))
    return KeySet(keys)


def _b64_json(segment: str) -> Any:
    """A base64url JSON segment of a token (or a proxy's payload header)."""
    try:
        raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
        return json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None


def shown_url(url: str) -> str:
    """A URL as logs show it: without credentials or a query."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.hostname or "", parts.path, "", "")) \
        if parts.port is None else f"{parts.scheme}://{parts.hostname}:{parts.port}{parts.path}"


class JwtReader:
    """Reads and verifies requests' tokens for one ruleset (see the
    module's docstring). ``keys`` is the JWKS read from a file at load,
    or None for a URL (fetched once ``start`` is called) or a token the
    proxy verified (``verified_by_proxy``)."""

    def __init__(self, *, header: str | None = "authorization", cookie: str | None = None,
                 payload_header: str | None = None, keys: KeySet | None = None, url: str | None = None,
                 refresh: float = 600.0, timeout: float = 5.0, verified_by_proxy: bool = False,
                 algorithms: tuple[str, ...] = ALGORITHMS, issuer: str | None = None,
                 audience: str | None = None, leeway: float = 0.0) -> None:
        self.header = header if cookie is None and payload_header is None else None
        self.cookie = cookie
        self.payload_header = payload_header
        self.keys = keys
        self.url = url
        self.refresh = refresh
        self.timeout = timeout
        self.verified_by_proxy = verified_by_proxy
        self.algorithms = algorithms
        self.issuer = issuer
        self.audience = audience
        self.leeway = leeway
        self.clock: Callable[[], float] = time.time
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.fetches: collections.Counter[str] = collections.Counter()
        # field -> (read, earliest, latest): a valid token's is valid from
        # earliest (nbf - leeway) until before latest (exp + leeway); the
        # others' never is (inf, -inf), and is their outcome at any time.
        self._cache: dict[str, tuple[TokenRead, float, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fetch_log = RateLimitedLog(log, 60)
        # The header the token's field is (None: the cookie).
        self._field = payload_header if payload_header is not None else self.header

    # -- lifecycle ------------------------------------------------------------

    def start(self, clock: Callable[[], float], outcomes: dict[str, int],
              fetches: collections.Counter[str]) -> None:
        """Read time from ``clock`` and count into the engine's counters;
        with a URL, fetch the keys now and every ``refresh`` seconds in a
        thread of its own (until ``close``)."""
        self.clock, self.outcomes, self.fetches = clock, outcomes, fetches
        if self.url is not None and self._thread is None:
            self._thread = threading.Thread(target=self._keep_fetching, name="sluice-jwks", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def follow(self, old: JwtReader) -> None:
        """After a reload: the keys ``old`` fetched from the same URL serve
        until this reader's first fetch, so that tokens stay valid across
        the reload."""
        if self.url is not None and self.url == old.url and self.keys is None and old.keys is not None:
            self.use_keys(old.keys)

    def _keep_fetching(self) -> None:
        while not self._stop.is_set():
            self.fetch()
            # Sooner while no key set was ever fetched.
            self._stop.wait(self.refresh if self.keys is not None else min(self.refresh, 5.0))

    def fetch(self) -> bool:
        """Fetch the JWKS from the URL; on any failure keep the keys
        there are (told at most once a minute)."""
        assert self.url is not None
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as answer:  # noqa: S310 - the file's URL
                body = answer.read(MAX_JWKS_BYTES + 1)
            if len(body) > MAX_JWKS_BYTES:
                raise ValueError(f"over {MAX_JWKS_BYTES} bytes")
            keys = parse_jwks(body, self.algorithms)
        except Exception as exc:  # noqa: BLE001 - a fetch that fails in any way keeps the last keys
            self.fetches["failed"] += 1
            self._fetch_log.warning("JWKS fetch from %s failed (%s); keeping %s", shown_url(self.url), exc,
                                    f"the last {len(self.keys)} keys" if self.keys is not None else "no keys")
            return False
        self.use_keys(keys)
        self.fetches["succeeded"] += 1
        return True

    def use_keys(self, keys: KeySet) -> None:
        """New keys from the next token on; what was found with the old
        ones is found again."""
        self.keys = keys
        self._cache = {}

    @property
    def key_count(self) -> int:
        return len(self.keys) if self.keys is not None else 0

    # -- the request path ---------------------------------------------------------

    def claim(self, request: CheckRequest, name: str) -> str | None:
        """A claim of the request's valid token as rules compare and count
        it, None without one (or for a JSON null): a string as it is,
        anything else as compact JSON (``42``, ``true``, ``["a","b"]``).
        The token is read once per request."""
        read = request.token
        if read is None:
            header = self._field
            field = request.headers.get(header) if header is not None else request.cookies.get(self.cookie or "")
            # A valid token remembered, in its time: found here, without
            # read's two calls (the common case, once per request).
            cached = self._cache.get(field) if field else None
            if cached is not None:
                now = self.clock()
                if cached[1] <= now < cached[2]:
                    read = cached[0]
                    self.outcomes["valid"] += 1
            if read is None:
                read = self.read(field)
            request.token = read
        value = read.claims.get(name)
        if value is None or type(value) is str:
            return value
        return json.dumps(value, separators=(",", ":"), sort_keys=True)

    def token_in(self, field: str) -> str | None:
        """The token in a request's field (its header's or cookie's value),
        or None."""
        if self.header is None:
            return field.strip()  # a cookie's, or a proxy's payload header
        scheme, _, rest = field.strip().partition(" ")
        if rest and scheme.lower() == "bearer":
            return rest.strip()
        return None if self.header == "authorization" else field.strip()

    def read(self, field: str | None) -> TokenRead:
        """What a request's field (``Authorization``'s value, the cookie's)
        gives now, counted by outcome. What a field gave is remembered by
        the field's text: a remembered valid token costs a lookup and its
        expiry check."""
        read = self._read(field)
        self.outcomes[read.outcome] += 1
        return read

    def _read(self, field: str | None) -> TokenRead:
        if not field:
            return MISSING
        if len(field) > MAX_TOKEN_LENGTH:
            return TokenRead("too_long")
        cached = self._cache.get(field)
        if cached is None:
            token = self.token_in(field)
            read, not_before, expires = self._examine(token) if token else (MISSING, 0.0, 0.0)
            cached = (read, not_before - self.leeway, expires + self.leeway) if read.outcome == "valid" \
                else (read, math.inf, -math.inf)
            if len(self._cache) >= CACHE_SIZE:
                self._cache = {}
            self._cache[field] = cached
        read, earliest, latest = cached
        if read.outcome != "valid":
            return read
        now = self.clock()
        if now < earliest:
            return TokenRead("not_yet_valid")
        if now >= latest:
            return TokenRead("expired")
        return read

    def _examine(self, token: str) -> tuple[TokenRead, float, float]:
        """The token's outcome before time is looked at, and its validity
        period (nbf, exp)."""
        if self.payload_header is not None:
            claims = _b64_json(token)
        elif self.verified_by_proxy:
            parts = token.split(".")
            claims = _b64_json(parts[1]) if len(parts) == 3 else None
        else:
            return self._verified(token)
        if not isinstance(claims, dict):
            return TokenRead("malformed"), 0.0, 0.0
        return self._timed(claims)

    def _verified(self, token: str) -> tuple[TokenRead, float, float]:
        keys = self.keys
        if keys is None:
            return TokenRead("no_keys"), 0.0, 0.0
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            return TokenRead("malformed"), 0.0, 0.0
        algorithm, key_id = header.get("alg"), header.get("kid")
        if not isinstance(algorithm, str) or algorithm not in self.algorithms:
            return TokenRead("algorithm"), 0.0, 0.0
        candidates = keys.candidates(key_id if isinstance(key_id, str) else None, algorithm)
        if not candidates:
            return TokenRead("unknown_key"), 0.0, 0.0
        outcome = "bad_signature"
        for key in candidates:
            try:
                claims = jwt.decode(token, key.key, algorithms=[algorithm], issuer=self.issuer,
                                    audience=self.audience,
                                    options={"verify_exp": False, "verify_nbf": False, "verify_iat": False,
                                             "verify_aud": self.audience is not None,
                                             "verify_iss": self.issuer is not None})
            except jwt.InvalidSignatureError:
                continue
            except (jwt.InvalidAudienceError, jwt.InvalidIssuerError, jwt.MissingRequiredClaimError):
                outcome = "bad_claims"
                break
            except jwt.InvalidTokenError:
                outcome = "malformed"
                break
            return self._timed(claims)
        return TokenRead(outcome), 0.0, 0.0

    @staticmethod
    def _timed(claims: dict[str, Any]) -> tuple[TokenRead, float, float]:
        """Valid claims and their period; a malformed ``exp`` or ``nbf``
        makes the token malformed."""
        period = []
        for name, default in (("nbf", float("-inf")), ("exp", float("inf"))):
            value = claims.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return TokenRead("malformed"), 0.0, 0.0
            period.append(float(value))
        return TokenRead("valid", claims), period[0], period[1]
