"""Requests Sluice's HTTP protocol hands to the ASGI application
(sidecar/exchange.py), on a loopback port: answers framed as RFC 9112 says
(chunked without a length, no body to HEAD), request bodies and 100-continue,
answers in the order of pipelined requests, the connection closed when
HTTP/1.0, the answer or a failing application asks for it, and a client's
departure seen by the application."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.asgi import Receive, Scope, Send
from sidecar.exchange import HEADER_VALUE_FORBIDDEN, encode_reply, forbidden_in_value
from sidecar.frontdoors.common import Reply, new_reply
from tests.unit.http_wire import LOOPBACK, closed_by_server, read_answer, request, serving


class Application:
    """Answers by path: /parts (two body parts, no length), /sum (the
    SHA-256 of the request body), /wait/<seconds>, /fail, /forged (a header
    value with a line break), /close (asks to close), /stay (waits for the
    client to leave); anything else: its path."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.left = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        headers: list[tuple[bytes, bytes]] = []
        if path == "/parts":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first,", "more_body": True})
            await send({"type": "http.response.body", "body": b"second"})
            return
        if path == "/sum":
            digest = hashlib.sha256()
            while True:
                message = await receive()
                digest.update(message.get("body", b""))
                if not message.get("more_body"):
                    break
            body = digest.hexdigest().encode()
        elif path.startswith("/wait/"):
            await asyncio.sleep(float(path.removeprefix("/wait/")))
            body = path.encode()
        elif path == "/fail":
            raise RuntimeError("the application failed")
        elif path == "/forged":
            headers.append((b"x-forged", b"a\r\nset-cookie: b"))
            body = b""
        elif path == "/close":
            headers.append((b"connection", b"close"))
            body = b"bye"
        elif path == "/stay":
            await receive()  # the request
            self.arrived.set()
            if (await receive())["type"] == "http.disconnect":
                self.left.set()
            return
        else:
            body = path.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def run(scenario: Any) -> Any:
    return asyncio.run(scenario)


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(LOOPBACK, port)


def test_an_answer_without_a_length_is_sent_chunked_and_the_connection_serves_the_next() -> None:
    async def scenario() -> tuple[Any, Any]:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/parts") + request("/after"))
            answers = await read_answer(reader), await read_answer(reader)
            writer.close()
            return answers

    (status, headers, body), after = run(scenario())
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"first,second")
    assert after[0] == 200 and after[2] == b"/after"


def test_a_head_request_gets_the_head_alone() -> None:
    async def scenario() -> tuple[Any, Any]:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/page", method="HEAD") + request("/next"))
            answers = await read_answer(reader, head_only=True), await read_answer(reader)
            writer.close()
            return answers

    head, after = run(scenario())
    # The next answer starts right after the head: no body was sent.
    assert head[0] == 200 and head[1]["content-length"] == "5"
    assert after[2] == b"/next"


@pytest.mark.parametrize("size", [0, 1, 200_000])
def test_a_request_body_reaches_the_application_in_full(size: int) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)

    async def scenario() -> bytes:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/sum", method="POST", body=body) + request("/sum", method="POST", body=b"2"))
            first, second = await read_answer(reader), await read_answer(reader)
            writer.close()
            assert second[2] == hashlib.sha256(b"2").hexdigest().encode()
            return first[2]

    assert run(scenario()) == hashlib.sha256(body).hexdigest().encode()


def test_a_client_expecting_100_continue_gets_it_before_sending_the_body() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            head = request("/sum", method="POST", Expect="100-continue", Content_Length="3")
            writer.write(head)
            interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(b"abc")
            answer = await read_answer(reader)
            writer.close()
            return interim, answer[2]

    interim, digest = run(scenario())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert digest == hashlib.sha256(b"abc").hexdigest().encode()


def test_pipelined_requests_are_answered_in_their_order() -> None:
    async def scenario() -> list[bytes]:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/wait/0.2") + request("/wait/0") + request("/wait/0.1") + request("/last"))
            bodies = [(await read_answer(reader))[2] for _ in range(4)]
            writer.close()
            return bodies

    assert run(scenario()) == [b"/wait/0.2", b"/wait/0", b"/wait/0.1", b"/last"]


@pytest.mark.parametrize("how", ["http/1.0", "answer asks"])
def test_the_connection_closes_after_an_answer_when_http_1_0_or_the_answer_asks(how: str) -> None:
    first = request("/page", version="1.0") if how == "http/1.0" else request("/close")

    async def scenario() -> tuple[Any, bool]:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(first + request("/never"))
            answer = await read_answer(reader)
            closed = await closed_by_server(reader)
            writer.close()
            return answer, closed

    (status, headers, _), closed = run(scenario())
    assert status == 200 and headers["connection"] == "close"
    assert closed  # the request after it is not answered


def test_an_application_failing_before_answering_gets_a_500_and_a_closed_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> tuple[Any, bool]:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/fail"))
            answer = await read_answer(reader)
            closed = await closed_by_server(reader)
            writer.close()
            return answer, closed

    with caplog.at_level(logging.ERROR, logger="sluice"):
        (status, headers, body), closed = run(scenario())
    assert (status, headers["connection"], body) == (500, "close", b"Internal Server Error") and closed
    assert "Exception in ASGI application" in caplog.text


def test_a_header_value_with_a_line_break_is_never_written() -> None:
    async def scenario() -> bytes:
        async with serving(Application()) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/forged"))
            sent = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return sent

    assert b"set-cookie" not in run(scenario())


def test_the_application_sees_the_client_leave() -> None:
    async def scenario() -> bool:
        application = Application()
        async with serving(application) as (port, _):
            reader, writer = await connect(port)
            writer.write(request("/stay"))
            await asyncio.wait_for(application.arrived.wait(), 5)
            writer.close()
            await asyncio.wait_for(application.left.wait(), 5)
            return application.left.is_set()

    assert run(scenario())


@given(st.binary(max_size=600) | st.text(max_size=600).map(lambda text: text.encode("utf-8")))
def test_a_value_is_forbidden_exactly_when_the_reference_pattern_finds_a_byte(value: bytes) -> None:
    assert forbidden_in_value(value) is bool(HEADER_VALUE_FORBIDDEN.search(value))


@given(st.text(max_size=200))
def test_a_check_answer_never_carries_a_forbidden_byte_in_a_field(value: str) -> None:
    content, keep_alive = encode_reply(Reply(403, [("X-Page", value)], b""), "GET", True, [])
    head = content.split(b"\r\n\r\n", 1)[0]
    for line in head.split(b"\r\n")[1:]:
        assert not HEADER_VALUE_FORBIDDEN.search(line.partition(b": ")[2])
    field = [line for line in head.split(b"\r\n") if line.startswith(b"x-page: ")]
    expected = value.encode("latin-1", "replace")
    assert field == [b"x-page: " + (b"" if HEADER_VALUE_FORBIDDEN.search(expected) else expected)]
    assert keep_alive


@given(st.sampled_from([200, 401, 403, 429]),
       st.lists(st.tuples(st.sampled_from(["X-Sluice-Pending", "Vary"]), st.text(max_size=5)), max_size=3),
       st.binary(max_size=8))
def test_a_reply_made_in_c_is_the_reply_the_named_tuple_makes(status: int, headers: list[tuple[str, str]],
                                                                body: bytes) -> None:
    made = new_reply((status, headers, body))
    assert type(made) is Reply and made == Reply(status, headers, body)
    assert (made.status, made.headers, made.body) == (status, headers, body)
    assert encode_reply(made, "GET", True, []) == encode_reply(Reply(status, headers, body), "GET", True, [])
