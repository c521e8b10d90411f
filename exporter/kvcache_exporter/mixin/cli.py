"""`kvcache-exporter mixin`: write the rules, alerts, Alertmanager files and dashboards.

    kvcache-exporter mixin --output DIR [--config my-thresholds.yaml]

DIR/rules/{recording,alerts}.yaml, DIR/alertmanager/ (alertmanager.yml, templates/) and
DIR/dashboards/*.json. The config file overrides any part of the defaults (`--print-defaults`
shows them); unknown keys are rejected. Dashboards are rendered with the `dashboards` extra
(pip install 'kvcache-exporter[dashboards]'); without it the pre-rendered dashboards are copied
when the config leaves what they show (thresholds, runbook URL) at the defaults, and otherwise
the extra is asked for (or --no-dashboards).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from . import config, rules
from .thresholds import DashboardThresholds

NEED_EXTRA = (
    "dashboards with your thresholds or runbook URL need the `dashboards` extra: "
    "pip install 'kvcache-exporter[dashboards]' (or pass --no-dashboards)"
)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "mixin",
        help="write the Prometheus rules, Alertmanager files and Grafana dashboards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", type=Path, help="directory to write into (created)")
    parser.add_argument("--config", type=Path, help="YAML overriding the default thresholds, windows, URLs")
    parser.add_argument("--no-dashboards", action="store_true", help="skip the Grafana dashboards")
    parser.add_argument("--print-defaults", action="store_true", help="print the default config and exit")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.print_defaults:
        sys.stdout.write(config.data_path("config.yaml").read_text())
        return 0
    if args.output is None:
        return _fail("--output: required (the directory to write into)")
    try:
        cfg = config.load(args.config)
        rules.render(cfg)  # checks what the schema cannot (a latency threshold on a bucket bound)
        dashboards = None if args.no_dashboards else _dashboards(cfg)
    except (config.ConfigError, ValueError, KeyError) as err:
        where = f"{args.config}: " if args.config and not isinstance(err, config.ConfigError) else ""
        return _fail(f"{where}{err}")
    source = (str(args.config), "rerun `kvcache-exporter mixin`") if args.config else None
    try:
        paths = write(args.output, cfg, dashboards, source)
    except OSError as err:
        return _fail(f"{err.filename or args.output}: cannot write: {err.strerror}")
    for path in paths:
        print(path)
    return 0


def write(out: Path, cfg: dict, dashboards: dict[str, str] | None, source: tuple[str, str] | None) -> list:
    """Every file of the mixin under `out`; returns their paths."""
    source = source or ("`kvcache-exporter mixin --print-defaults`", "render again with --config FILE")
    paths = rules.write(out / "rules", cfg, source=source)
    alertmanager = out / "alertmanager"
    shutil.copytree(config.data_path("alertmanager"), alertmanager, dirs_exist_ok=True)
    paths += sorted(p for p in alertmanager.rglob("*") if p.is_file())
    for name, text in (dashboards or {}).items():
        (out / "dashboards").mkdir(parents=True, exist_ok=True)
        (path := out / "dashboards" / name).write_text(text)
        paths.append(path)
    return paths


def _dashboards(cfg: dict) -> dict[str, str]:
    try:
        from .dashboards import render
    except ImportError as err:
        if not (err.name or "").startswith("grafana_foundation_sdk"):
            raise
        if DashboardThresholds.of(cfg) != DashboardThresholds.of(
            config.defaults()
        ):  # all a dashboard reads of the config
            raise ValueError(NEED_EXTRA) from None
        shipped = sorted(config.data_path("dashboards").glob("*.json"))
        return {p.name: p.read_text() for p in shipped}
    return render.render_all(cfg)


def _fail(message: str) -> int:
    print(f"kvcache-exporter mixin: {message}", file=sys.stderr)
    return 1
