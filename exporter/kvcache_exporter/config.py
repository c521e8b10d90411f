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
from collections.abc import Callable, Container
from dataclasses import fields, replace
from typing import Any

from . import fleet_publish_kit, fleet_view_kit
from .derive import audit_kit, cost_kit
from .durations import window_label
from .options import (
    AGGREGATE_ENV_PREFIX,
    DEFAULT_PORT,
    Option,
    at_least,
    choice,
    duration,
    listen_address,
    named_patterns,
    on_off,
    positive_size,
    price_table,
    ratio,
    size,
    size_text,
)
from .settings import AggregateSettings, ServiceSettings, Settings
from .sources import engine_kit, gpu_kit, kv_events_kit


class ConfigError(ValueError):
    """One or more `location: message` lines; the location is a flag, an environment variable or
    file:key. Resolving collects every problem of flags, environment and file before raising."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


OPTIONS: tuple[Option, ...] = (
    *engine_kit.OPTIONS,
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
    *gpu_kit.OPTIONS,
    *cost_kit.OPTIONS,
    *kv_events_kit.OPTIONS,
    *audit_kit.OPTIONS,
    *fleet_publish_kit.OPTIONS,
)
BY_KEY = {o.key: o for o in OPTIONS}
AGGREGATE_DEFAULT_PORT = 18091  # beside serve's 18090, outside the allocated exporter range 9100-9999
_AGGREGATE_DEFAULTS = {"collect.windows": [300.0, 3600.0], "web.listen_address": f":{AGGREGATE_DEFAULT_PORT}"}


def shared(*keys: str) -> tuple[Option, ...]:
    """serve's options as `aggregate` has them: the same parse and validation, aggregate's env
    twin and, for a few, aggregate's own default."""
    return tuple(
        replace(
            BY_KEY[key],
            env_prefix=AGGREGATE_ENV_PREFIX,
            default=_AGGREGATE_DEFAULTS.get(key, BY_KEY[key].default),
        )
        for key in keys
    )


# aggregate's rows' own options (fleet_view_kit.py), then those it shares with serve, in
# ServiceSettings' order (some declared by its rows too: aggregator/rows.py)
AGGREGATE_OPTIONS: tuple[Option, ...] = (
    *fleet_view_kit.OPTIONS,
    *shared(*(next(o.key for o in OPTIONS if o.attr == f.name) for f in fields(ServiceSettings))),
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


def _refuse_taken(options: tuple[Option, ...], keys: Container[str], settings_type: type) -> None:
    """A source's options (kit.register) whose key the table, or whose attribute the settings, has."""
    taken = [o.key for o in options if o.key in keys or o.attr in settings_type.__dataclass_fields__]
    if taken:
        raise ValueError(f"option declared twice: {', '.join(taken)}")


def add_serve_options(options: tuple[Option, ...]) -> None:
    """A source's own options (kit.register), after the built-in ones."""
    global OPTIONS
    _refuse_taken(options, BY_KEY, Settings)
    OPTIONS = OPTIONS + tuple(options)
    BY_KEY.update((o.key, o) for o in options)


def add_aggregate_options(options: tuple[Option, ...]) -> None:
    """A source's own options (kit.register) as `aggregate` has them (its environment twin), after
    the built-in ones."""
    global AGGREGATE_OPTIONS
    _refuse_taken(options, {o.key for o in AGGREGATE_OPTIONS}, AggregateSettings)
    AGGREGATE_OPTIONS = AGGREGATE_OPTIONS + tuple(
        replace(o, env_prefix=AGGREGATE_ENV_PREFIX) for o in options
    )


def _settings(settings_type: type, values: dict[str, Any], by_key: dict[str, Option]) -> Any:
    """Resolved values (by option key) as the command's settings: its own fields, and a registered
    source's options (kit.register) in `source_options`."""
    fields = settings_type.__dataclass_fields__
    by_attr = {by_key[k].attr: v for k, v in values.items()}
    return settings_type(
        **{a: v for a, v in by_attr.items() if a in fields},
        source_options={a: v for a, v in by_attr.items() if a not in fields},
    )


def resolve(flags: dict[str, Any], environ: dict[str, str], config_file: str | None) -> Settings:
    """`serve`'s settings: defaults, file, environment and flags merged (`flags` maps keys to raw
    strings or lists); ConfigError lists every problem at once."""
    values, problems, failed = _resolve(OPTIONS, flags, environ, config_file)
    gpu_kit.from_environment(values, environ)
    fleet_publish_kit.from_environment(values, environ)
    settings = _settings(Settings, values, BY_KEY)
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
    settings = _settings(AggregateSettings, values, by_key)
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
    out = engine_kit.checks(s)
    out += _common_checks(s)
    out += gpu_kit.checks(s)
    out += kv_events_kit.checks(s)
    out += fleet_publish_kit.checks(s)
    return out


def aggregate_checks(s: AggregateSettings) -> list[tuple[str, str]]:
    return fleet_view_kit.checks(s) + _common_checks(s)


def validate(s: Settings) -> None:
    """Raise every problem `checks` finds."""
    _settle([], checks(s), set())


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
