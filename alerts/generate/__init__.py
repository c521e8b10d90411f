"""Write alerts/rules/{recording,alerts}.yaml from alerts/config.yaml (`make generate`).

    python -m alerts.generate [--config alerts/config.yaml] [--out alerts/rules] [--scale 1]

The rules are made by the package (kvcache_exporter.mixin), which users run as
`kvcache-exporter mixin`; this entry point keeps the repository's paths as defaults.
`--scale` multiplies every duration (windows, offsets, `for:`, evaluation interval) so the
end-to-end test can run the same rules in seconds; rule names keep the configured windows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from kvcache_exporter.durations import parse_duration as seconds
from kvcache_exporter.mixin import rules

HERE = Path(__file__).resolve().parent.parent  # alerts/
__all__ = ["HERE", "main", "seconds", "write"]


def write(out: Path, scale: float = 1.0, config: Path = HERE / "config.yaml") -> list[Path]:
    """This file is the defaults themselves (the package's data/config.yaml is its copy)."""
    return rules.write(out, yaml.safe_load(config.read_text()), scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--out", type=Path, default=HERE / "rules")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every duration (e2e tests)")
    args = parser.parse_args(argv)
    for path in write(args.out, args.scale, args.config):
        print(f"wrote {path}")
    return 0
