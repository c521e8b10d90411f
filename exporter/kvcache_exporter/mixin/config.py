"""The mixin's one config: every threshold, window and URL of the rules and the dashboards.

The defaults ship in the package (data/config.yaml, a copy of the repository's alerts/config.yaml
made by `make generate`). A user's file overrides any part of them: mappings merge key by key,
lists and scalars replace. Unknown keys and values of the wrong kind are rejected with
`location: message`, the way the exporter's own config file is validated.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import yaml

from ..durations import parse_duration


class ConfigError(ValueError):
    """Every problem found in a config file, one `location: message` per line."""


def data_path(*parts: str) -> Path:
    """A file shipped under kvcache_exporter/mixin/data/."""
    return Path(str(resources.files("kvcache_exporter.mixin").joinpath("data", *parts)))


def is_duration(value: object) -> bool:
    try:
        parse_duration(value)
    except ValueError:
        return False
    return True


def defaults() -> dict:
    return yaml.safe_load(data_path("config.yaml").read_text())


def load(path: Path | None = None, base: dict | None = None) -> dict:
    """The defaults (or `base`), overridden by the YAML file at `path`; raises ConfigError."""
    base = defaults() if base is None else base
    if path is None:
        return base
    try:
        user = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    if user is None:
        return base
    errors: list[str] = []
    merged = _merge(base, user, (), errors)
    if errors:
        raise ConfigError("\n".join(f"{path}: {e}" for e in errors))
    return merged


def _merge(default: object, user: object, where: tuple[str, ...], errors: list[str]) -> object:
    location = ".".join(where) or "(top level)"
    if isinstance(default, dict):
        if not isinstance(user, dict):
            errors.append(f"{location}: expected a mapping, got {_kind(user)}")
            return default
        merged = dict(default)
        for key, value in user.items():
            if key not in default:
                known = ", ".join(sorted(map(str, default)))
                errors.append(f"{'.'.join((*where, str(key)))}: unknown key (known: {known})")
                continue
            merged[key] = _merge(default[key], value, (*where, str(key)), errors)
        return merged
    if isinstance(default, list) and default and isinstance(default[0], dict) and isinstance(user, list):
        return [_item(default[0], item, (*where, str(i)), errors) for i, item in enumerate(user)]
    problem = _check_leaf(default, user)
    if problem:
        errors.append(f"{location}: {problem}")
        return default
    return user


def _item(template: dict, user: object, where: tuple[str, ...], errors: list[str]) -> object:
    """A list entry shaped like the defaults' first entry: the same keys, every one given."""
    missing = sorted(set(template) - set(user)) if isinstance(user, dict) else []
    if missing:
        errors.append(f"{'.'.join(where)}: missing {', '.join(missing)}")
    return _merge(template, user, where, errors)


def _check_leaf(default: object, user: object) -> str | None:
    if is_duration(default):
        return None if is_duration(user) else f"expected a duration such as {default!r}, got {user!r}"
    if isinstance(default, list):
        if not isinstance(user, list) or not user:
            return f"expected a non-empty list, got {_kind(user)}"
        problems = [_check_leaf(default[0], item) for item in user] if default else []
        return next((p for p in problems if p), None)
    if isinstance(default, bool | str):
        return None if type(user) is type(default) else f"expected {_kind(default)}, got {_kind(user)}"
    if isinstance(default, int | float):
        if isinstance(user, bool) or not isinstance(user, int | float):
            return f"expected a number, got {_kind(user)}"
        if not math.isfinite(user) or user < 0:
            return f"expected a finite number >= 0, got {user!r}"
    return None


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else repr(value)
    )
