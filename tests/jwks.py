"""A JWKS server on loopback for the tests, and the keys it serves.

``Issuer`` holds signing keys of each kind (HS256, RS256, ES256, EdDSA) and
signs tokens with them; ``JwksServer`` serves the public half of the ones
it is told to (``rotate`` swaps them while it runs, ``stop_answering``
makes every fetch fail), counting the fetches it answered.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from tests.loopback_http import LoopbackServer, QuietHandler

ALGORITHMS = ("HS256", "RS256", "ES256", "EdDSA")


class Issuer:
    """Keys of each algorithm (one set per ``generation``), and tokens
    signed with them."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, int], Any] = {}

    def private(self, algorithm: str, generation: int = 0) -> Any:
        found = self._keys.get((algorithm, generation))
        if found is None:
            if algorithm == "HS256":
                found = f"secret-{generation}-".encode() * 5
            elif algorithm == "RS256":
                found = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            elif algorithm == "ES256":
                found = ec.generate_private_key(ec.SECP256R1())
            else:
                found = ed25519.Ed25519PrivateKey.generate()
            self._keys[algorithm, generation] = found
        return found

    @staticmethod
    def kid(algorithm: str, generation: int = 0) -> str:
        return f"{algorithm.lower()}-{generation}"

    def jwk(self, algorithm: str, generation: int = 0) -> dict[str, Any]:
        """The key's JWK: its public half (an HMAC key is its secret)."""
        key = self.private(algorithm, generation)
        if algorithm == "HS256":
            entry: dict[str, Any] = {"kty": "oct", "k": base64.urlsafe_b64encode(key).rstrip(b"=").decode()}
        elif algorithm == "RS256":
            entry = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        elif algorithm == "ES256":
            entry = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
        else:
            entry = json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(key.public_key()))
        return {**entry, "kid": self.kid(algorithm, generation), "alg": algorithm, "use": "sig"}

    def jwks(self, algorithms: tuple[str, ...] = ALGORITHMS, generation: int = 0) -> dict[str, Any]:
        return {"keys": [self.jwk(algorithm, generation) for algorithm in algorithms]}

    def token(self, claims: dict[str, Any], algorithm: str = "RS256", generation: int = 0,
              kid: str | None = None, lifetime: float | None = 3600.0) -> str:
        """A token of ``claims``, expiring ``lifetime`` seconds from now
        (never with None)."""
        payload = dict(claims)
        if lifetime is not None and "exp" not in payload:
            payload["exp"] = int(time.time() + lifetime)
        headers = {"kid": kid if kid is not None else self.kid(algorithm, generation)}
        return jwt.encode(payload, self.private(algorithm, generation), algorithm=algorithm, headers=headers)


class JwksServer(LoopbackServer):
    """Serves a JWKS at ``url`` from 127.0.0.1 until ``close``."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.answering = True
        self.fetches = 0
        server = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - the server's method name
                if not server.answering:
                    self.send_error(503)
                    return
                server.fetches += 1
                self.reply(200, "application/json", json.dumps(server.document).encode())

        super().__init__(Handler)
        self.url = f"{self.base}/.well-known/jwks.json"

    def rotate(self, document: dict[str, Any]) -> None:
        self.document = document
