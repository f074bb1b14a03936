"""The rules file's JSON Schema (``sluice schema``), for editors.

Generated from the models of ``sidecar.config``, so that it follows them:
their fields, types, defaults, bounds and docstrings. What the models take
through a validator of their own is described here, where pydantic alone
would allow anything (a duration, a rate, a network: plain validators) or
refuse what the loader accepts (one item where a list is expected).

The loader stays the authority: it also checks what a schema cannot say
(duplicate rule ids, settings that exclude each other, files named in the
rules, the range of a duration written with a unit). A file the loader
accepts is valid against the schema; ``sluice check`` says the rest.

The schema is JSON Schema draft-07, the draft the YAML language server
(and with it VS Code's and most editors' YAML support) validates.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from sidecar.config import (
    RulesFile,
    parse_asn,
    parse_country,
    parse_dimension,
    parse_duration,
    parse_host_port,
    parse_network,
    parse_rate,
    parse_refill,
    parse_regex,
    parse_tier_name,
    parse_tier_threshold,
)
from sidecar.config.values import TIER_NAME_PATTERN

DRAFT = "http://json-schema.org/draft-07/schema#"
# Where a checkout keeps the generated schema, which the examples name.
SCHEMA_FILE = "schema/sluice-rules.schema.json"
REGENERATE = f"sluice schema --out {SCHEMA_FILE}"

# A positive number, as the loader's parsers read it (a leading zero is
# allowed, zero itself is not).
_POSITIVE_INTEGER = r"[0-9]*[1-9][0-9]*"
_POSITIVE_NUMBER = rf"(?:{_POSITIVE_INTEGER}(?:\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)"

# A duration's terms go from the largest unit to the smallest, each unit at
# most once (1h30m); one number at least is not zero. Its upper bound is
# the loader's to check.
_DURATION_UNITS = ("y", "w", "d", "h", "m", "s", "ms")
_DURATION_TERMS = "".join(rf"(?:\s*[0-9]+(?:\.[0-9]+)?\s*{unit})?" for unit in _DURATION_UNITS)
DURATION = {
    "description": "Seconds, or numbers with units from the largest to the smallest: "
                   "500ms, 10s, 15m, 1h30m, 1d12h, 2w, 1y.",
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0},
        {"type": "string", "pattern": rf"^(?=[\s\S]*[1-9])(?=\s*[0-9]){_DURATION_TERMS}\s*$"},
    ],
}

# What each plain validator of sidecar.config accepts.
_PLAIN: dict[Callable[..., Any], JsonSchemaValue] = {
    parse_duration: DURATION,
    parse_rate: {
        "description": "Requests per second or per minute, as nginx's limit_req writes them: 10r/s, 30r/m.",
        "type": "string", "pattern": rf"^\s*{_POSITIVE_INTEGER}\s*r/[sm]\s*$",
    },
    parse_refill: {
        "description": "Tokens added per second or per minute: 2/s, 30/m, 0.5/s.",
        "type": "string", "pattern": rf"^\s*{_POSITIVE_NUMBER}\s*/[sm]\s*$",
    },
    parse_network: {
        "description": "An address, or a network in CIDR notation without host bits: 10.0.0.0/8, 2001:db8::/32.",
        "type": "string",
    },
    parse_regex: {"description": "A regular expression (Python's syntax), searched anywhere in the value.",
                  "type": "string"},
    parse_host_port: {
        "description": "HOST:PORT of a sentinel (the port defaults to 26379; an IPv6 address in brackets).",
        "type": "string",
    },
    parse_asn: {"description": "An autonomous system's number: 64500, or AS64500.",
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 4294967295},
                          {"type": "string", "pattern": r"^\s*(?:[Aa][Ss])?[0-9]{1,10}\s*$"}]},
    parse_country: {"description": "A country's two-letter ISO code: DE, nl.", "type": "string",
                    "pattern": r"^\s*[A-Za-z]{2}\s*$"},
    parse_tier_name: {"description": "A tier's name: 1-32 letters, digits, '_', '.', '-'.", "type": "string",
                      "pattern": TIER_NAME_PATTERN},
    parse_tier_threshold: {
        "description": "A tier's threshold: a number in the rule's own period (2000), or the number per that "
                       "period (2000/1m, 100/min).",
        "anyOf": [{"type": "integer", "minimum": 0},
                  {"type": "string", "pattern": r"^\s*[0-9]{1,12}\s*/\s*\S+\s*$"}],
    },
    parse_dimension: {
        "description": "What the counting key is made of: ip, host, method, path, uri, asn, country, ja3, ja4, "
                       "or header:NAME, cookie:NAME, query:NAME, session:COOKIE, jwt:CLAIM.",
        "anyOf": [
            {"enum": ["ip", "host", "method", "path", "uri", "asn", "country", "ja3", "ja4"]},
            {"type": "string", "pattern": r"^(?:header|cookie|query|session|jwt):[\s\S]*\S"},
        ],
    },
}

# A value of each core type, to ask a before-validator whether it turns one
# item into a list of it (``method: GET`` for ``method: [GET]``).
_SAMPLE_ITEMS: dict[str, object] = {"str": "GET", "int": 1, "float": 1.0, "bool": True}


class RulesSchema(GenerateJsonSchema):
    """pydantic's schema generator, told what sidecar.config's own
    validators accept."""

    def function_plain_schema(self, schema: core_schema.PlainValidatorFunctionSchema) -> JsonSchemaValue:
        function = schema["function"]["function"]
        try:
            return dict(_PLAIN[function])
        except KeyError:
            raise TypeError(f"no JSON schema for the validator {function.__qualname__} of sidecar.config: "
                            "say what it accepts in sidecar/schema.py (_PLAIN)") from None

    def function_before_schema(self, schema: core_schema.BeforeValidatorFunctionSchema) -> JsonSchemaValue:
        generated = super().function_before_schema(schema)
        inner, function = schema["schema"], schema["function"]
        if inner["type"] != "list" or "items_schema" not in inner or function["type"] != "no-info":
            return generated
        item = _SAMPLE_ITEMS.get(inner["items_schema"]["type"], {})
        try:
            one_item_allowed = function["function"](item) == [item]
        except (TypeError, ValueError):
            one_item_allowed = False
        if not one_item_allowed:
            return generated
        return {"anyOf": [self.generate_inner(inner["items_schema"]), generated]}


def rules_schema() -> dict[str, Any]:
    """The JSON Schema of a rules file."""
    generated = RulesFile.model_json_schema(ref_template="#/definitions/{model}", schema_generator=RulesSchema)
    definitions = generated.pop("$defs")
    # The loader refuses a file without `rules:` (an empty or truncated
    # file must not turn rate limiting off): `rules: []` says it on purpose.
    generated["required"] = ["rules"]
    return {
        "$schema": DRAFT,
        **generated,
        "title": "Sluice rules file",
        "description": "Sluice's rules file. `sluice check FILE` validates what a schema cannot "
                       "(duplicate ids, settings that exclude each other, files it names). "
                       f"Generated by `{REGENERATE}`.",
        "definitions": definitions,
    }


def rules_schema_text() -> str:
    """The schema as the file ``sluice schema`` writes: stable, diffable JSON."""
    return json.dumps(rules_schema(), indent=2, ensure_ascii=False) + "\n"
