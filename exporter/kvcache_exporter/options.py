"""The option table's row (`Option`) and the parsers its rows use: a leaf, so a source can declare
its options beside its code (the *_kit.py modules) and config.py concatenate them."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .durations import parse_duration

ENV_PREFIX = "KVCACHE_EXPORTER_"
AGGREGATE_ENV_PREFIX = "KVCACHE_AGGREGATE_"
DEFAULT_PORT = 18090


_SIZE = re.compile(r"(\d+)\s*(|B|KiB|MiB|GiB|KB|MB|GB)")
_SIZES = {
    "": 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}
duration = parse_duration  # the one grammar (durations.py): flags and YAML alike need a unit


def size(text: Any) -> int:
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f'invalid size "{text}" (use e.g. 8MiB)')
    return int(match.group(1)) * _SIZES[match.group(2)]


def positive_size(text: Any) -> int:
    value = size(text)
    if value <= 0:
        raise ValueError(f'size "{text}" must be above 0')
    return value


def ratio(text: Any) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(f"{value} is not between 0 and 1")
    return value


def price(text: Any) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"price {value} is negative")
    return value


def http_url(text: Any) -> str:
    parts = urlsplit(str(text))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f'"{text}" is not an http(s) URL')
    try:
        parts.port  # noqa: B018 (the property raises on a port outside 0-65535)
    except ValueError:
        raise ValueError(f'"{text}" has no valid port (0-65535)') from None
    return str(text)


_TCP_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[\w.-]+):(\*|\d{1,5})")


def zmq_endpoint(text: Any) -> str:
    """A ZMQ endpoint as vLLM takes one: tcp://HOST:PORT (`*` for a wildcard host or port),
    ipc://PATH or inproc://NAME. ZMQ itself would refuse anything else only when binding."""
    value = str(text)
    match = _TCP_ENDPOINT.fullmatch(value)
    if match and (match[2] == "*" or int(match[2]) < 65536):
        return value
    if value.startswith(("ipc://", "inproc://")) and value.partition("://")[2].strip():
        return value
    raise ValueError(f'"{text}" is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME)')


def listen_address(text: Any) -> str:
    _, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f'"{text}" is not host:port')
    return str(text)


def price_table(value: Any) -> dict[str, float]:
    """GPU model name -> price per GPU-hour; from YAML a mapping, from a flag `NAME=PRICE` items."""
    if isinstance(value, dict):
        return {str(k): price(v) for k, v in value.items()}
    items = value if isinstance(value, list) else [value]
    table = {}
    for item in items:
        name, sep, amount = str(item).rpartition("=")
        if not sep or not name:
            raise ValueError(f'"{item}" is not GPU_MODEL=PRICE')
        table[name] = price(amount)
    return table


def named_patterns(value: Any) -> dict[str, str]:
    """Field patterns (derive/fields.py): from YAML a mapping, from a flag `NAME=REGEX` items; each
    vetted here, so a pattern that could backtrack for long is refused at start-up."""
    from .derive.fields import Rules

    if isinstance(value, dict):
        table = {str(k): str(v) for k, v in value.items()}
    else:
        table = {}
        for item in value if isinstance(value, list) else [value]:
            name, sep, pattern = str(item).partition("=")
            if not sep or not name:
                raise ValueError(f'"{item}" is not NAME=REGEX')
            table[name] = pattern
    Rules.with_patterns(table)
    return table


def on_off(value: Any) -> bool:
    text = str(value).lower()
    if text not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
        raise ValueError(f'"{value}" is not true or false')
    return text in ("true", "on", "1", "yes")


def at_least(minimum: int) -> Callable[[Any], int]:
    def parse(text: Any) -> int:
        try:
            value = int(str(text))
        except ValueError:
            raise ValueError(f'"{text}" is not a whole number') from None
        if value < minimum:
            raise ValueError(f"{value} is below {minimum}")
        return value

    parse.__name__ = "integer"
    return parse


def between(minimum: int, maximum: int) -> Callable[[Any], int]:
    def parse(text: Any) -> int:
        value = at_least(minimum)(text)
        if value > maximum:
            raise ValueError(f"{value} is above {maximum}")
        return value

    parse.__name__ = "integer"
    return parse


# One subscriber (a socket and a thread) per rank: 10,000 ranks cost 8,000 threads and 18,000 open
# files before serve listened. vLLM's data-parallel deployments run tens of ranks per node.
MAX_DATA_PARALLEL_SIZE = 256


def choice(*allowed: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        if str(text) not in allowed:
            raise ValueError(f'"{text}" is not one of {", ".join(allowed)}')
        return str(text)

    parse.choices = allowed  # type: ignore[attr-defined]  # --help lists them
    return parse


def sampling(text: Any) -> float:
    value = ratio(text)
    if value == 0:
        raise ValueError("0 keeps no hash at all: use a fraction above 0")
    return value


def port(text: Any) -> int:
    value = at_least(0)(text)
    if value > 65535:
        raise ValueError(f"{value} is not a port (0-65535)")
    return value


def shard(text: Any) -> str:
    """`K/N`: keep the K-th of N hash ranges (0 <= K < N)."""
    index, sep, count = str(text).partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not int(index) < int(count):
        raise ValueError(f'"{text}" is not K/N with 0 <= K < N')
    return str(text)


def nats_url(text: Any) -> str:
    parts = urlsplit(str(text))
    if parts.scheme not in ("nats", "tls") or not parts.hostname:
        raise ValueError(f'"{text}" is not a nats:// or tls:// URL')
    return str(text)


def subject_token(text: Any) -> str:
    """A name that goes into NATS subjects: one token, no wildcard."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(text)):
        raise ValueError(f'"{text}" is not a name of 1-64 letters, digits, _ or -')
    return str(text)


def subject_prefix(text: Any) -> str:
    if not all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", part) for part in str(text).split(".")):
        raise ValueError(f'"{text}" is not dot-separated names of letters, digits, _ or -')
    return str(text)


@dataclass(frozen=True)
class Option:
    key: str  # section.name, as in the YAML file
    parse: Callable[[Any], Any]
    default: Any
    help: str
    multiple: bool = False  # a list: repeat the flag, comma-separate the env var, a YAML list
    flag_name: str = ""  # where Prometheus convention differs from the key (--web.config.file)
    env_prefix: str = ENV_PREFIX
    separator: str | None = ","  # between a list's items in one value; None: whitespace

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return self.env_prefix + re.sub(r"[.-]", "_", self.flag[2:]).upper()

    @property
    def attr(self) -> str:
        return re.sub(r"[.-]", "_", self.key)


def size_text(n: int) -> str:
    """8388608 -> 8MiB: the largest binary unit that divides it."""
    for unit in ("GiB", "MiB", "KiB"):
        if n and n % _SIZES[unit] == 0:
            return f"{n // _SIZES[unit]}{unit}"
    return f"{n}B"
