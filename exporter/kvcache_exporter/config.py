"""Settings for `serve` and `aggregate`: one table each drives the flags, their environment twins
and the YAML file; both go through the same parsers and checks.

Precedence: defaults < --config.file < environment (KVCACHE_EXPORTER_*, KVCACHE_AGGREGATE_*) < flags.
Flag `--vllm.bearer-token-file` = YAML `vllm: {bearer_token_file: ...}` = env
`KVCACHE_EXPORTER_VLLM_BEARER_TOKEN_FILE`. Unknown YAML keys are errors (with the closest key).
Every problem of flags, environment and file is reported at once, one `location: message` a line.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlsplit

from .durations import parse_duration, window_label
from .settings import AggregateSettings, ServiceSettings, Settings

ENV_PREFIX = "KVCACHE_EXPORTER_"
DEFAULT_PORT = 18090


class ConfigError(ValueError):
    """One or more `location: message` lines; the location is a flag, an environment variable or
    file:key. Resolving collects every problem of flags, environment and file before raising."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


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


OPTIONS: tuple[Option, ...] = (
    Option(
        "vllm.url",
        http_url,
        ["http://127.0.0.1:8000/metrics"],
        "vLLM /metrics URL; repeat for several servers",
        True,
    ),
    Option("vllm.timeout", duration, 5.0, "timeout of one poll of vLLM"),
    Option(
        "vllm.bearer_token_file", str, None, "file holding a bearer token sent to vLLM (re-read every poll)"
    ),
    Option("vllm.max_body_bytes", positive_size, 8 * 1024**2, "largest /metrics body accepted from vLLM"),
    Option(
        "engine.kind",
        choice("auto", "vllm", "sglang"),
        "auto",
        "the engine behind --vllm.url: auto (told by each page's metric names), vllm or sglang",
        flag_name="--engine",
    ),
    Option("collect.interval", duration, 5.0, "how often the exporter polls its sources"),
    Option(
        "collect.windows",
        duration,
        [60.0, 300.0, 900.0, 3600.0],
        "sliding windows for ratios and quantiles",
        True,
    ),
    Option("collect.quantiles", ratio, [0.5, 0.9, 0.99], "latency quantiles to export", True),
    Option("web.listen_address", listen_address, f":{DEFAULT_PORT}", "address to serve /metrics on"),
    Option("web.telemetry_path", str, "/metrics", "path of the metrics endpoint"),
    Option(
        "web.config_file",
        str,
        None,
        "Prometheus web-config file: TLS and basic auth",
        False,
        "--web.config.file",
    ),
    Option("web.max_connections", at_least(1), 256, "open connections at most, TLS handshakes included"),
    Option(
        "web.idle_timeout", duration, 60.0, "an idle connection (or one that sends nothing) is closed after"
    ),
    Option("web.tls_handshake_timeout", duration, 10.0, "a TLS handshake must finish within"),
    Option("log.level", choice("debug", "info", "warn", "error"), "info", "log level"),
    Option("log.format", choice("logfmt", "json"), "logfmt", "log format"),
    Option("gpu.source", choice("auto", "nvml", "dcgm", "none"), "auto", "GPU telemetry source"),
    Option("gpu.devices", str, [], "NVML devices to watch, by index or UUID (default: all visible)", True),
    Option("gpu.dcgm_url", http_url, None, "dcgm-exporter /metrics URL (gpu.source=dcgm)"),
    Option("gpu.dcgm_timeout", duration, 5.0, "timeout of one poll of dcgm-exporter"),
    Option("gpu.pod", str, None, "keep the DCGM series of this pod (default: $POD_NAME)"),
    Option("gpu.namespace", str, None, "namespace of that pod (default: $POD_NAMESPACE)"),
    Option("gpu.uuids", str, [], "keep the DCGM series of these GPU UUIDs", True),
    Option("gpu.max_processes", at_least(0), 8, "per-process GPU memory series per GPU, at most"),
    Option("cost.gpu_hour_price", price, None, "price of one GPU-hour (any GPU model)"),
    Option("cost.gpu_hour_prices", price_table, {}, "price per GPU-hour by GPU model name: NAME=PRICE", True),
    Option(
        "cost.gpu_count",
        at_least(1),
        1,
        "GPUs this vLLM uses: prices the cost when no GPU telemetry is available",
    ),
    Option("cost.currency", str, "USD", "currency of the prices"),
    Option("cost.energy_price_per_kwh", price, None, "price of a kWh, for energy cost per token"),
    Option("cost.hit_ratio_floor", ratio, 0.6, "hit ratio used to price the cost of a cache collapse"),
    Option(
        "kv_events.endpoint",
        zmq_endpoint,
        None,
        "vLLM KV-event ZMQ endpoint, e.g. tcp://127.0.0.1:5557 (default: where vLLM says it publishes)",
    ),
    Option(
        "kv_events.discovery",
        choice("on", "off"),
        "on",
        "ask vLLM's /kv_event_sources where each rank publishes, unless an endpoint is named (on, off)",
    ),
    Option(
        "kv_events.mode",
        choice("bind", "connect"),
        "bind",
        "bind (vLLM connects to a concrete host) or connect",
    ),
    Option(
        "kv_events.replay_endpoint",
        zmq_endpoint,
        None,
        "vLLM's replay ROUTER endpoint, to fill sequence gaps",
    ),
    Option(
        "kv_events.data_parallel_size",
        between(1, MAX_DATA_PARALLEL_SIZE),
        1,
        "vLLM's --data-parallel-size: one stream per rank (rank r on the endpoint's port + r),"
        " each labelled engine=r like vLLM's /metrics",
    ),
    Option("kv_events.topic", str, "", "ZMQ topic to subscribe to"),
    Option(
        "kv_events.max_batches_per_second",
        at_least(1),
        20000,
        "event batches accepted per second, more are dropped",
    ),
    Option(
        "kv_events.max_tracked_blocks",
        at_least(1),
        400_000,
        "block hashes the KV-event view and miss attribution remember (keep >= 10x num_gpu_blocks;"
        " ~350 bytes each with their fingerprints)",
    ),
    Option(
        "kv_events.max_fingerprints",
        at_least(1),
        800_000,
        "content fingerprints miss attribution remembers (~2 per 32 tokens stored; ~70 bytes each)",
    ),
    Option(
        "kv_events.engine",
        choice("vllm", "sglang", "trtllm"),
        "vllm",
        "the engine publishing the KV events named by --kv-events.endpoint: its media and page rules"
        " (vllm, sglang, trtllm; discovery sets it from what the server says)",
    ),
    Option(
        "whatif.host_tier_bytes",
        size,
        None,
        "a host (CPU) KV tier to estimate the hit ratio with (default: the tier vLLM reports, if any)",
    ),
    Option(
        "fields.tokenizer",
        str,
        None,
        "the served model's tokenizer.json (or its folder): name the per-request field in front of"
        " diverged prefixes (needs --kv-events.endpoint and the tokenizers library)",
    ),
    Option(
        "fields.patterns",
        named_patterns,
        {},
        "extra named field patterns NAME=REGEX, tried before the built-in ones (at most 8)",
        True,
    ),
    Option("fields.max_per_second", at_least(1), 20, "diverged prompt fronts decoded and named per second"),
    Option(
        "fields.debug_endpoint",
        on_off,
        False,
        "serve /debug/fields (redacted shapes of recent fronts) behind the same auth as /metrics",
    ),
    Option(
        "audit.gpu_memory_utilization_ceiling",
        ratio,
        0.9,
        "highest gpu_memory_utilization that passes the audit on a GPU shared with other processes",
    ),
    Option("fleet.publish", nats_url, None, "NATS JetStream URL to publish this replica's residency to"),
    Option("fleet.pool", subject_token, "default", "the model pool's name in NATS subjects"),
    Option("fleet.replica", subject_token, None, "this replica's name in NATS subjects (default: $POD_NAME)"),
    Option("fleet.hash_sampling", sampling, 1.0, "fraction of block hashes published (0 < f <= 1)"),
    Option("fleet.subject_prefix", subject_prefix, "kvcache", "first tokens of the pool's NATS subjects"),
    Option("fleet.credentials_file", str, None, "NATS credentials file (JWT and NKey seed, .creds)"),
    Option("fleet.nkey_seed_file", str, None, "NATS NKey seed file"),
    Option("fleet.tls_ca_file", str, None, "CA certificate(s) to verify the NATS server with"),
)
BY_KEY = {o.key: o for o in OPTIONS}
AGGREGATE_ENV_PREFIX = "KVCACHE_AGGREGATE_"
AGGREGATE_DEFAULT_PORT = 18091  # beside serve's 18090, outside the allocated exporter range 9100-9999


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


_AGGREGATE_DEFAULTS = {"collect.windows": [300.0, 3600.0], "web.listen_address": f":{AGGREGATE_DEFAULT_PORT}"}


def _shared(attr: str) -> Option:
    """One of serve's options for `aggregate`: the same parse and validation, aggregate's env twin
    and, for a few, aggregate's own default."""
    option = next(o for o in OPTIONS if o.attr == attr)
    default = _AGGREGATE_DEFAULTS.get(option.key, option.default)
    return replace(option, env_prefix=AGGREGATE_ENV_PREFIX, default=default)


def _twin(key: str) -> Option:
    """One of serve's fleet options, as it is for `aggregate`."""
    return replace(BY_KEY[key], env_prefix=AGGREGATE_ENV_PREFIX)


def _aggregate(key: str, parse: Callable[[Any], Any], default: Any, help: str, **more: Any) -> Option:
    return Option(key, parse, default, help, env_prefix=AGGREGATE_ENV_PREFIX, **more)


AGGREGATE_OPTIONS: tuple[Option, ...] = (
    _aggregate(
        "replica.targets",
        str,
        [],
        "TARGET[,KV_ENDPOINT[,ENGINE]] of a replica (host:port or URL; ENGINE vllm, sglang or trtllm);"
        " repeat, whitespace-separated in the env",
        multiple=True,
        flag_name="--replica",
        separator=None,
    ),
    _aggregate("discovery.file_sd", str, None, "Prometheus file_sd JSON/YAML file, re-read on change"),
    _aggregate("discovery.dns", str, None, "NAME:PORT of a headless Service (A/AAAA records)"),
    _aggregate(
        "discovery.refresh_interval",
        duration,
        30.0,
        "how often --discovery.dns is resolved, and each replica's /kv_event_sources asked, again",
    ),
    _aggregate(
        "replica.kv_events_port",
        port,
        5557,
        "KV-event port of a replica that names none, where its vLLM does not say (0: none)",
    ),
    _aggregate("replica.max", at_least(1), 64, "replicas watched at most; the rest are counted left out"),
    _aggregate("replica.max_blocks", at_least(1), 131_072, "block hashes remembered per replica"),
    _aggregate("fleet.hash_sampling", sampling, 1.0, "fraction of block hashes kept (0 < f <= 1)"),
    _aggregate("fleet.shard", shard, "0/1", "K/N: keep the K-th of N hash ranges"),
    _aggregate("fleet.source", nats_url, None, "NATS JetStream URL to read the pool's residency from"),
    *(_twin(key) for key in ("fleet.pool", "fleet.subject_prefix")),
    _aggregate("fleet.retention", duration, 6 * 3600.0, "how long the pool's stream keeps deltas"),
    _aggregate("fleet.max_bytes", size, 8 * 1024**3, "the pool's stream size at most"),
    _aggregate(
        "fleet.stream_replicas",
        between(1, 5),
        1,
        "JetStream replicas of the pool's stream when this shard creates it (3 on a 3-node cluster)",
    ),
    *(_twin(key) for key in ("fleet.credentials_file", "fleet.nkey_seed_file", "fleet.tls_ca_file")),
    *(_shared(f.name) for f in fields(ServiceSettings)),
)


def _split(option: Option, item: Any) -> list[Any]:
    if not isinstance(item, str):
        return [item]
    if not option.separator:
        return item.split()
    items = [v for v in item.split(option.separator) if v != ""]
    if items and len(items) <= item.count(option.separator):  # "1m,,5m": a typo, not two windows
        raise ValueError(f'"{item}" has an empty item')
    return items


def _parse(option: Option, value: Any, location: str) -> Any:
    try:
        if option.multiple and option.parse in (price_table, named_patterns):  # NAME=VALUE items, unsplit
            return option.parse(value)
        if option.multiple:
            raw = value if isinstance(value, list) else [value]
            return [option.parse(v) for item in raw for v in _split(option, item)]
        return option.parse(value)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{location}: {err}") from err


def _flatten(
    data: Any, path: str, location: str, keys: dict[str, Option], problems: list[str]
) -> dict[str, Any]:
    if not isinstance(data, dict):
        problems.append(f"{location}: {path or 'top level'} must be a mapping")
        return {}
    sections = {k.rsplit(".", 1)[0] for k in keys}
    flat = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if full in keys:
            flat[full] = value
        elif full in sections:
            flat.update(_flatten(value, full, location, keys, problems))
        else:
            hint = difflib.get_close_matches(full, [*keys, *sections], n=1)
            problems.append(
                f"{location}:{full}: unknown key" + (f" (did you mean {hint[0]}?)" if hint else "")
            )
    return flat


def load_file(path: str, options: tuple[Option, ...] = OPTIONS) -> dict[str, Any]:
    """The file's values by key; raises ConfigError with every problem in it."""
    problems: list[str] = []
    values = _load_file(path, {o.key: o for o in options}, problems)
    if problems:
        raise ConfigError(*problems)
    return values


def _load_file(path: str, keys: dict[str, Option], problems: list[str]) -> dict[str, Any]:
    import yaml  # here, not at the top: only --config.file needs it (~1 MiB of serve's RSS)

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        problems.append(f"{path}: {err.strerror}")
        return {}
    except UnicodeDecodeError as err:
        problems.append(f"{path}: not UTF-8 text (byte {err.start})")
        return {}
    except yaml.YAMLError as err:
        problems.append(f"{path}: invalid YAML: {err}")
        return {}
    values = {}
    for key, raw in _flatten(data, "", path, keys, problems).items():
        try:
            values[key] = _parse(keys[key], raw, f"{path}:{key}")
        except ConfigError as err:
            problems += err.problems
    return values


def _resolve(
    options: tuple[Option, ...], flags: dict[str, Any], environ: dict[str, str], config_file: str | None
) -> tuple[dict[str, Any], list[str], set[str]]:
    """Defaults < file < environment < flags: the values, every problem found, the keys that failed."""
    values = {o.key: o.default for o in options}
    problems: list[str] = []
    failed: set[str] = set()
    if config_file:
        before = len(problems)
        values.update(_load_file(config_file, {o.key: o for o in options}, problems))
        failed |= {o.key for o in options for p in problems[before:] if f":{o.key}:" in p}
    for o in options:
        for raw, location in ((environ.get(o.env), o.env), (flags.get(o.key), o.flag)):
            if raw is None:
                continue
            try:
                values[o.key] = _parse(o, raw, location)
            except ConfigError as err:
                problems += err.problems
                failed.add(o.key)
    return values, problems, failed


def _settle(problems: list[str], checks: list[tuple[str, str]], failed_flags: set[str]) -> None:
    """Raise every problem; a cross-option check on a value that already failed says nothing new."""
    problems = problems + [f"{flag}: {msg}" for flag, msg in checks if flag not in failed_flags]
    if problems:
        raise ConfigError(*problems)


def _pod_name(environ: dict[str, str]) -> str | None:
    try:
        return subject_token(environ.get("POD_NAME", ""))
    except ValueError:
        return None


def add_serve_options(options: tuple[Option, ...]) -> None:
    """A source's own options (kit.register), after the built-in ones."""
    global OPTIONS
    taken = [o.key for o in options if o.key in BY_KEY or o.attr in Settings.__dataclass_fields__]
    if taken:
        raise ValueError(f"option declared twice: {', '.join(taken)}")
    OPTIONS = OPTIONS + tuple(options)
    BY_KEY.update((o.key, o) for o in options)


def resolve(flags: dict[str, Any], environ: dict[str, str], config_file: str | None) -> Settings:
    """`serve`'s settings: defaults, file, environment and flags merged (`flags` maps keys to raw
    strings or lists); ConfigError lists every problem at once."""
    values, problems, failed = _resolve(OPTIONS, flags, environ, config_file)
    values["gpu.pod"] = values["gpu.pod"] or environ.get("POD_NAME")
    values["gpu.namespace"] = values["gpu.namespace"] or environ.get("POD_NAMESPACE")
    values["fleet.replica"] = values["fleet.replica"] or _pod_name(environ)
    fields = Settings.__dataclass_fields__
    by_attr = {BY_KEY[k].attr: v for k, v in values.items()}
    settings = Settings(
        **{a: v for a, v in by_attr.items() if a in fields},
        source_options={a: v for a, v in by_attr.items() if a not in fields},
    )
    _settle(problems, checks(settings), {BY_KEY[k].flag for k in failed})
    return settings


def resolve_aggregate(
    flags: dict[str, Any],
    environ: dict[str, str],
    config_file: str | None,
    check: Callable[[AggregateSettings], object] | None = None,
) -> AggregateSettings:
    """`aggregate`'s settings, resolved and checked exactly like `serve`'s; `check` (the aggregator's
    discovery set-up) may raise ConfigError, whose problems join the others."""
    values, problems, failed = _resolve(AGGREGATE_OPTIONS, flags, environ, config_file)
    by_key = {o.key: o for o in AGGREGATE_OPTIONS}
    settings = AggregateSettings(**{by_key[k].attr: v for k, v in values.items()})
    try:
        if check is not None:
            check(settings)
    except ConfigError as err:
        problems += err.problems
    _settle(problems, aggregate_checks(settings), {by_key[k].flag for k in failed})
    return settings


_RESERVED_PATHS = ("/", "/healthz", "/readyz")


def _common_checks(s: ServiceSettings) -> list[tuple[str, str]]:
    out = []
    if not s.collect_windows:
        out.append(("--collect.windows", "at least one window is needed"))
    if any(w < s.collect_interval for w in s.collect_windows):
        out.append(("--collect.windows", "every window must be at least --collect.interval"))
    if not s.web_telemetry_path.startswith("/"):
        out.append(("--web.telemetry-path", "must start with /"))
    elif s.web_telemetry_path in _RESERVED_PATHS:
        out.append(("--web.telemetry-path", f"{s.web_telemetry_path} is taken by the exporter itself"))
    return out


def checks(s: Settings) -> list[tuple[str, str]]:
    """What start-up would reject, found before it: --check-config runs exactly this."""
    out = []
    if not s.vllm_url:
        out.append(("--vllm.url", "at least one vLLM URL is needed"))
    out += _common_checks(s)
    if s.gpu_source == "dcgm" and not s.gpu_dcgm_url:
        out.append(("--gpu.dcgm-url", "needed with --gpu.source=dcgm"))
    dcgm = s.gpu_source == "dcgm" or (s.gpu_source == "auto" and s.gpu_dcgm_url)
    if dcgm and not s.gpu_pod and not s.gpu_uuids:
        out.append(("--gpu.pod", "the dcgm GPU source needs this pod's name ($POD_NAME) or --gpu.uuids"))
    if s.fields_debug_endpoint and not s.fields_tokenizer:
        out.append(("--fields.debug-endpoint", "needs --fields.tokenizer (it shows the fields that names)"))
    if s.fields_tokenizer and not s.kv_events_endpoint and s.kv_events_discovery != "on":
        out.append(("--fields.tokenizer", "needs KV events: --kv-events.endpoint or discovery on"))
    elif s.fields_tokenizer:
        from .model_tokenizer import load_tokenizer

        try:
            load_tokenizer(s.fields_tokenizer, "pip install tokenizers")
        except ValueError as err:
            out.append(("--fields.tokenizer", str(err)))
    if s.fleet_publish and not s.fleet_replica:
        out.append(("--fleet.replica", "--fleet.publish needs this replica's name (or $POD_NAME)"))
    if s.fleet_publish and not s.kv_events_endpoint and s.kv_events_discovery != "on":
        out.append(("--fleet.publish", "publishes KV events: --kv-events.endpoint or discovery on"))
    return out


def aggregate_checks(s: AggregateSettings) -> list[tuple[str, str]]:
    out = []
    if not (s.replica_targets or s.discovery_file_sd or s.discovery_dns or s.fleet_source):
        out.append(
            (
                "--replica",
                "name the replicas (--replica, --discovery.file-sd, --discovery.dns) or --fleet.source",
            )
        )
    return out + _common_checks(s)


def validate(s: Settings) -> None:
    """Raise every problem `checks` finds."""
    _settle([], checks(s), set())


def size_text(n: int) -> str:
    """8388608 -> 8MiB: the largest binary unit that divides it."""
    for unit in ("GiB", "MiB", "KiB"):
        if n and n % _SIZES[unit] == 0:
            return f"{n // _SIZES[unit]}{unit}"
    return f"{n}B"


def default_text(option: Option) -> str:
    """The default as the README and a flag write it: 5s, 8MiB, 1m,5m; "unset" when there is none."""
    value = option.default
    if value in (None, [], {}):
        return "unset"
    if value == "":
        return '""'
    show = {
        duration: window_label,
        size: size_text,
        positive_size: size_text,
        on_off: lambda v: str(v).lower(),
    }.get(option.parse, str)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return ",".join(show(v) for v in value) if isinstance(value, list) else show(value)


def add_options(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    """--config.file, --check-config and one flag per option; values stay raw until resolve."""
    parser.add_argument(
        "--config.file", dest="config_file", help="optional YAML file with the same keys as the flags"
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration and exit (0, or 2 and every problem)",
    )
    for option in options:
        choices = getattr(option.parse, "choices", None)
        default = default_text(option)
        said = default == "unset" and "(default: " in option.help  # the help says what unset means
        parser.add_argument(
            option.flag,
            dest=option.attr,
            action="append" if option.multiple else "store",
            metavar="{" + ",".join(choices) + "}" if choices else option.key.rsplit(".", 1)[-1].upper(),
            help=f"{option.help} (env {option.env}" + ("" if said else f"; default {default}") + ")",
        )
