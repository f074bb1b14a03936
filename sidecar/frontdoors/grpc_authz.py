"""Envoy gRPC ext_authz: ``envoy.service.auth.v3.Authorization/Check``.

Served by ``grpc.aio`` in the HTTP server's event loop, on a port of its own
(``sluice serve --grpc-port``). The request's ``attributes`` become a
``CheckRequest``; the answer is the one the HTTP front doors give
(``answer_in_full``), carried in the ``CheckResponse``: a refusal's status,
headers and page in ``denied_response``, an allow's headers in
``ok_response.response_headers_to_add``, and what the shipped Envoy Lua
filter acts on (the pending token, a close) in ``dynamic_metadata``, where
the HTTP door's ``dynamic_metadata_from_headers`` puts them too.

The messages are declared in ``sidecar.frontdoors.messages``.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc

from sidecar.asgi import Scope
from sidecar.frontdoors.common import Check, Reply, join_fields
from sidecar.frontdoors.forward_auth import answer_in_full
from sidecar.frontdoors.messages import (
    CHECK_METHOD,
    CHECK_SERVICE,
    OVERWRITE_IF_EXISTS_OR_ADD,
    CheckResponse,
    HeaderValueOption,
    reader,
)
from sidecar.frontdoors.messages import CheckRequest as CheckRequestMessage
from sidecar.request import CheckRequest, check_request, strip_port

# google.rpc.Code values of CheckResponse.status.
RPC_OK = 0
RPC_PERMISSION_DENIED = 7
# What the Lua filter reads from ext_authz's dynamic metadata (see
# sluice-response-filter.yaml): the same keys over HTTP and gRPC.
METADATA_HEADERS = ("x-sluice-pending", "connection")
# The scope key under which the gRPC request reaches ``describe_grpc``.
GRPC_MESSAGE = "sluice.grpc.check"


def request_headers(http: Any) -> dict[str, str]:
    """The original request's header fields by lower-case name, without
    HTTP/2 pseudo-headers (``:path``, ``:authority``: the request line and
    Host come from their own fields). ``header_map`` (Envoy's
    ``encode_raw_headers``) keeps repeated fields apart; they are joined
    as the HTTP front doors join them."""
    if http.header_map.headers:
        fields = [(entry.key, entry.value or entry.raw_value.decode("latin-1"))
                  for entry in http.header_map.headers]
    else:
        fields = list(http.headers.items())
    return join_fields((name, value) for name, value in fields if not name.startswith(":"))


def describe_grpc(scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """The original method, path (with the query) and host; the client is
    the direct peer (``attributes.source``), walked back through
    X-Forwarded-For when it is a trusted proxy; the time Envoy received the
    request (``attributes.request.time``) is when it was sent, for late
    checks (sidecar.overload), never a header of the client's."""
    attributes = scope[GRPC_MESSAGE].attributes
    http = attributes.request.http
    request = check_request(
        headers,
        method=http.method or "GET",
        host=strip_port(http.host or headers.get("host", "")),
        uri=http.path or "/",
        peer=attributes.source.address.socket_address.address,
    )
    received = attributes.request.time
    request.sent = received.seconds + received.nanos / 1e9 if received.seconds > 0 else 0.0
    return request


# Served by the gRPC port only, always through the awaited path
# (``SluiceApp.check_later``): no ``at_once``.
GRPC_CHECK = Check("envoy_grpc", describe_grpc, answer_in_full)


def check_response(reply: Reply) -> Any:
    """The front door's answer as a ``CheckResponse``: 200 allows, any
    other status refuses with that status, headers and body."""
    status, headers, body = reply
    response = CheckResponse()
    metadata = {name.lower(): value for name, value in headers if name.lower() in METADATA_HEADERS}
    if metadata:
        response.dynamic_metadata.update(metadata)
    if status == 200:
        response.status.code = RPC_OK
        response.ok_response.SetInParent()
        response.ok_response.response_headers_to_add.extend(
            header_option(name, value) for name, value in headers if name.lower() not in METADATA_HEADERS)
        return response
    response.status.code = RPC_PERMISSION_DENIED
    denied = response.denied_response
    # Over gRPC, Envoy sends any status it is given, 5xx included: no
    # X-Sluice-Status detour as over HTTP. HttpStatus.code is an open enum;
    # statuses it does not name (451) pass all the same.
    denied.status.code = status
    denied.headers.extend(header_option(name, value) for name, value in headers)
    denied.body = body.decode("utf-8", "replace")
    return response


def header_option(name: str, value: str) -> Any:
    option = HeaderValueOption()
    option.header.key = name.lower()
    option.header.value = value
    option.append_action = OVERWRITE_IF_EXISTS_OR_ADD
    return option


class CheckingService(Protocol):
    """What the gRPC service is handed: ``sidecar.app.SluiceApp``, which
    decides a check, fails open on a failure inside Sluice and counts it."""

    async def check_later(self, check: Check, scope: Scope, headers: dict[str, str]) -> Reply: ...

    def internal_error(self) -> None: ...


def check_handler(service: CheckingService) -> Any:
    """``Authorization/Check`` for a gRPC server: the decision of
    ``service``, or an allow when that fails inside Sluice (counted)."""

    async def check(message: Any, context: Any) -> Any:
        if message is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a CheckRequest")
        try:
            headers = request_headers(message.attributes.request.http)
            reply = await service.check_later(GRPC_CHECK, {"type": "grpc", GRPC_MESSAGE: message}, headers)
            return check_response(reply)
        except Exception:
            service.internal_error()
            return check_response(Reply(200, [], b""))

    method = grpc.unary_unary_rpc_method_handler(check, request_deserializer=reader(CheckRequestMessage),
                                                 response_serializer=CheckResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(CHECK_SERVICE, {CHECK_METHOD: method})
