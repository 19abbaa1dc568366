"""One log format for wkvm's and uvicorn's loggers: text lines with timestamps, or one JSON object per line.

Every record goes to stderr through the root logger, so uvicorn's startup and access lines look like wkvm's own.
The same dictionary configures logging before the model loads and is handed to uvicorn (`log_config`), which
would otherwise install its own two formats without timestamps.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from typing import Any
from urllib.parse import unquote_plus

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
QUIET_LOGGERS = ("httpx", "httpcore")  # one INFO line per HTTP request they make: noise in a CLI or a server log
# a query parameter whose name says it holds a credential (`?api_key=`, `?token=`, `?access_token=`...): clients
# that cannot set headers send keys this way (the server refuses them, 401), and uvicorn logs the whole query
SECRET_NAME = re.compile(r"(?i)key|token|secret|pass|pwd|auth|sig|bearer|credential|jwt|session")


def redact_path(path: str) -> str:
    """`path` with the values of its credential-like query parameters replaced by ***: names read percent-decoded
    (`k%65y` is `key` to the server), a value up to the next `&` (a `#` in a request target is no fragment). Part by
    part: a regex over the whole query backtracked on names without `=` (64 KB of "key" held the event loop 2.3 s)."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = []
    for part in query.split("&"):
        name, eq, _ = part.partition("=")
        parts.append(f"{name}=***" if eq and SECRET_NAME.search(unquote_plus(name)) else part)
    return f"{base}?{'&'.join(parts)}"


class RedactQuery(logging.Filter):
    """Access lines without credentials in their query strings (the record's path rewritten; never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            args = list(record.args)
            if isinstance(args[2], str):
                args[2] = redact_path(args[2])
                record.args = tuple(args)
        return True


class JsonFormatter(logging.Formatter):
    """time, level, logger, message; access lines add client, method, path and status."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        # uvicorn logs an access line as (client, method, path, http version, status)
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args
            line.update(client=client, method=method, path=path, status=status)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def wkvm_logger(level: str = "info", fmt: str = "text") -> None:
    """wkvm's own loggers at `level` through one stderr handler in `fmt`, leaving the root logger to its owner: in a
    process wkvm does not start (a Ray Serve replica), where Ray has set up logging and an unconfigured logger would
    show only warnings."""
    log_config(level, fmt)  # checks both
    logger = logging.getLogger("wkvm")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logger.handlers = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def log_config(level: str = "info", fmt: str = "text") -> dict[str, Any]:
    """A `logging.config.dictConfig` dictionary: every logger through one stderr handler in `fmt`."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level {level!r} / format {fmt!r}: use one of {LEVELS} / {FORMATS}")
    formatter: dict[str, object] = {"()": JsonFormatter} if fmt == "json" else {"format": TEXT_FORMAT}
    loggers: dict[str, dict[str, object]] = {name: {"handlers": [], "propagate": True} for name in UVICORN_LOGGERS}
    loggers.update({name: {"level": "WARNING"} for name in QUIET_LOGGERS})
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"wkvm": formatter},
        "filters": {"redact": {"()": RedactQuery}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "wkvm", "stream": "ext://sys.stderr",
                       "filters": ["redact"]}  # fmt: skip
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": loggers,
    }
