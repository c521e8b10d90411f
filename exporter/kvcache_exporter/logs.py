"""logfmt or JSON log lines, the formats Prometheus components use."""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
    fields = {
        "ts": stamp,
        "level": record.levelname.lower().replace("warning", "warn"),
        "msg": record.getMessage(),
    }
    fields.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
    if record.exc_info:
        fields["err"] = logging.Formatter().formatException(record.exc_info)
    return fields


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_quote(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def _quote(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n'):
        return text
    return json.dumps(text)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class Throttled:
    """A warning at most once per `seconds` (hostile input repeats; the log must not flood)."""

    def __init__(self, logger: logging.Logger, seconds: float = 60.0):
        self.logger, self.seconds = logger, seconds
        self._quiet_until = float("-inf")

    def warning(self, message: str, *args: object) -> bool:
        now = time.monotonic()
        if now < self._quiet_until:
            return False
        self._quiet_until = now + self.seconds
        self.logger.warning(message + " (next such line in %.0f s at the earliest)", *args, self.seconds)
        return True
