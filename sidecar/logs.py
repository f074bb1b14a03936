"""Sluice's own log lines as JSON, uvicorn's included, so that everything on
stderr — these lines and the decision log's — parses line by line.

Each line is ``{"time", "level", "logger", "message"}`` (and ``"error"``,
the traceback, when one is logged); the decision log (``sluice.decisions``)
writes its own bare JSON lines.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sidecar.decisionlog import iso_time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {"time": iso_time(record.created), "level": record.levelname.lower(),
                                    "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def logging_config(level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for Sluice's and uvicorn's loggers
    (uvicorn takes it as ``log_config``)."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": handler},
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {name: {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def configure_logging(level: str) -> None:
    import logging.config

    logging.config.dictConfig(logging_config(level))
