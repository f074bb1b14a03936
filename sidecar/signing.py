"""Signed tokens: base64url text and HMAC-SHA256 signatures, compared in
constant time.

Every token Sluice hands out (pending response counts, challenges,
challenge credentials) is signed with a key derived from the node secret
for that one purpose, so a token of one kind can never pass for another.
"""

from __future__ import annotations

import base64
import hashlib
import hmac


def b64encode(data: bytes) -> str:
    """URL-safe base64 without padding: safe in headers, cookies and forms."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64decode(text: str) -> bytes:
    """The inverse of ``b64encode``; raises ValueError (binascii.Error) on junk."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def derive_key(secret: bytes, purpose: bytes) -> bytes:
    """A key of ``secret`` for one ``purpose`` only."""
    return hmac.new(secret, purpose, hashlib.sha256).digest()


class Signer:
    """Signs messages for one purpose; ``length`` bytes of the HMAC are kept."""

    __slots__ = ("_key", "_length")

    def __init__(self, secret: bytes, purpose: bytes, length: int = 16) -> None:
        self._key = derive_key(secret, purpose)
        self._length = length

    def sign(self, message: bytes) -> str:
        return b64encode(hmac.new(self._key, message, hashlib.sha256).digest()[:self._length])

    def verifies(self, message: bytes, signature: str) -> bool:
        """Whether ``signature`` is this message's, in constant time."""
        return hmac.compare_digest(signature.encode("ascii", "replace"), self.sign(message).encode("ascii"))
