"""Settings for `serve`: one table drives the flags, their environment twins and the YAML file.

Precedence: defaults < --config.file < KVCACHE_EXPORTER_* environment < flags.
Flag `--vllm.bearer-token-file` = YAML `vllm: {bearer_token_file: ...}` = env
`KVCACHE_EXPORTER_VLLM_BEARER_TOKEN_FILE`. Unknown YAML keys are errors.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .settings import Settings

ENV_PREFIX = "KVCACHE_EXPORTER_"
DEFAULT_PORT = 18090


class ConfigError(ValueError):
    """`location: message` — the location is a flag, an environment variable or file:key."""


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
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


def duration(text: Any) -> float:
    """Prometheus-style duration (`90s`, `1m30s`, `1h`) or plain seconds, in seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        parts = _DURATION.findall(str(text))
        if not parts or "".join(n + u for n, u in parts) != str(text):
            raise ValueError(f'invalid duration "{text}" (use e.g. 5s, 1m, 1h30m)')
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f'duration "{text}" must be positive')
    return seconds


def size(text: Any) -> int:
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f'invalid size "{text}" (use e.g. 8MiB)')
    return int(match.group(1)) * _SIZES[match.group(2)]


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
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f'"{text}" is not an http(s) URL')
    return str(text)


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


def choice(*allowed: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        if str(text) not in allowed:
            raise ValueError(f'"{text}" is not one of {", ".join(allowed)}')
        return str(text)

    return parse


@dataclass(frozen=True)
class Option:
    key: str  # section.name, as in the YAML file
    parse: Callable[[Any], Any]
    default: Any
    help: str
    multiple: bool = False  # a list: repeat the flag, comma-separate the env var, a YAML list
    flag_name: str = ""  # where Prometheus convention differs from the key (--web.config.file)

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + re.sub(r"[.-]", "_", self.key).upper()

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
    Option("vllm.max_body_bytes", size, 8 * 1024**2, "largest /metrics body accepted from vLLM"),
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
    Option("kv_events.endpoint", str, None, "vLLM KV-event ZMQ endpoint, e.g. tcp://127.0.0.1:5557"),
    Option(
        "kv_events.mode",
        choice("bind", "connect"),
        "bind",
        "bind (vLLM connects to a concrete host) or connect",
    ),
    Option("kv_events.replay_endpoint", str, None, "vLLM's replay ROUTER endpoint, to fill sequence gaps"),
    Option(
        "kv_events.data_parallel_size",
        at_least(1),
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
        "whatif.host_tier_bytes",
        size,
        None,
        "a host (CPU) KV tier to estimate the hit ratio with (default: the tier vLLM reports, if any)",
    ),
    Option(
        "audit.gpu_memory_utilization_ceiling",
        ratio,
        0.9,
        "highest gpu_memory_utilization that passes the audit on a GPU shared with other processes",
    ),
)
BY_KEY = {o.key: o for o in OPTIONS}


def _parse(option: Option, value: Any, location: str) -> Any:
    try:
        if option.multiple and option.parse is price_table:
            return price_table(value)
        if option.multiple:
            raw = value if isinstance(value, list) else [value]
            items = [
                v
                for item in raw
                for v in (str(item).split(",") if isinstance(item, str) else [item])
                if v != ""
            ]
            return [option.parse(v) for v in items]
        return option.parse(value)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{location}: {err}") from err


def _flatten(data: Any, path: str, location: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{location}: {path or 'top level'} must be a mapping")
    flat = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if full in BY_KEY:
            flat[full] = value
        elif isinstance(value, dict) and any(k.startswith(full + ".") for k in BY_KEY):
            flat.update(_flatten(value, full, location))
        else:
            hint = difflib.get_close_matches(full, BY_KEY, n=1)
            raise ConfigError(
                f"{location}:{full}: unknown key" + (f" (did you mean {hint[0]}?)" if hint else "")
            )
    return flat


def load_file(path: str) -> dict[str, Any]:
    import yaml  # here, not at the top: only --config.file needs it (~1 MiB of serve's RSS)

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    return {key: _parse(BY_KEY[key], v, f"{path}:{key}") for key, v in _flatten(data, "", path).items()}


def resolve(flags: dict[str, Any], environ: dict[str, str], config_file: str | None) -> Settings:
    """Merge defaults, file, environment and flags (`flags` maps keys to raw strings or lists)."""
    values = {o.key: o.default for o in OPTIONS}
    if config_file:
        values.update(load_file(config_file))
    for o in OPTIONS:
        if o.env in environ:
            values[o.key] = _parse(o, environ[o.env], o.env)
        if flags.get(o.key) is not None:
            values[o.key] = _parse(o, flags[o.key], o.flag)
    values["gpu.pod"] = values["gpu.pod"] or environ.get("POD_NAME")
    values["gpu.namespace"] = values["gpu.namespace"] or environ.get("POD_NAMESPACE")
    settings = Settings(**{BY_KEY[k].attr: v for k, v in values.items()})
    validate(settings)
    return settings


_RESERVED_PATHS = ("/", "/healthz", "/readyz")


def validate(s: Settings) -> None:
    """What start-up would reject, found before it: --check-config runs exactly this."""
    if not s.vllm_url:
        raise ConfigError("--vllm.url: at least one vLLM URL is needed")
    if not s.collect_windows:
        raise ConfigError("--collect.windows: at least one window is needed")
    if any(w < s.collect_interval for w in s.collect_windows):
        raise ConfigError("--collect.windows: every window must be at least --collect.interval")
    if s.gpu_source == "dcgm" and not s.gpu_dcgm_url:
        raise ConfigError("--gpu.dcgm-url: needed with --gpu.source=dcgm")
    dcgm = s.gpu_source == "dcgm" or (s.gpu_source == "auto" and s.gpu_dcgm_url)
    if dcgm and not s.gpu_pod and not s.gpu_uuids:
        raise ConfigError("--gpu.pod: the dcgm GPU source needs this pod's name ($POD_NAME) or --gpu.uuids")
    if not s.web_telemetry_path.startswith("/"):
        raise ConfigError("--web.telemetry-path: must start with /")
    if s.web_telemetry_path in _RESERVED_PATHS:
        raise ConfigError(f"--web.telemetry-path: {s.web_telemetry_path} is taken by the exporter itself")


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
    show = {duration: window_label, size: size_text}.get(option.parse, str)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return ",".join(show(v) for v in value) if isinstance(value, list) else show(value)


def window_label(seconds: float) -> str:
    """60 -> 1m, 3600 -> 1h, 100 -> 1m40s: the `window` label value, in PromQL duration style."""
    parts, rest = [], round(seconds * 1000)
    for unit, size_ms in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if rest >= size_ms:
            parts.append(f"{rest // size_ms}{unit}")
            rest %= size_ms
    return "".join(parts) or "0s"
