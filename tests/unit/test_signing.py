"""Signed tokens: one key per purpose, constant-time checks, junk refused."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.signing import Signer, b64decode, b64encode

SECRET = b"a node secret of enough length"


@given(st.binary(max_size=200))
def test_base64url_round_trips_without_padding(data: bytes) -> None:
    text = b64encode(data)
    assert "=" not in text and "+" not in text and "/" not in text
    assert b64decode(text) == data


def test_a_signature_verifies_only_its_message_and_purpose() -> None:
    pending, challenge = Signer(SECRET, b"pending"), Signer(SECRET, b"challenge")
    signature = pending.sign(b"message")
    assert pending.verifies(b"message", signature)
    assert not pending.verifies(b"messagE", signature)
    assert not challenge.verifies(b"message", signature)
    assert not Signer(b"another secret", b"pending").verifies(b"message", signature)


@pytest.mark.parametrize("junk", ["", "x", "é" * 30, "\x00" * 22])
def test_junk_signatures_are_refused_without_raising(junk: str) -> None:
    assert not Signer(SECRET, b"pending").verifies(b"message", junk)


def test_the_length_kept_is_the_length_asked_for() -> None:
    assert len(b64decode(Signer(SECRET, b"p").sign(b"m"))) == 16
    assert len(b64decode(Signer(SECRET, b"p", length=32).sign(b"m"))) == 32
