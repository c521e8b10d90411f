"""Write dashboards/json/*.json from alerts/config.yaml (`make generate`).

    python -m dashboards [--config alerts/config.yaml] [--out dashboards/json]

The dashboards are made by the package (kvcache_exporter.mixin.dashboards), which users run as
`kvcache-exporter mixin`; this entry point keeps the repository's paths as defaults.
"""

import argparse
import sys
from pathlib import Path

import yaml

from kvcache_exporter.mixin.dashboards import render

ROOT = Path(__file__).resolve().parent.parent
parser = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
parser.add_argument("--config", type=Path, default=ROOT / "alerts" / "config.yaml")
parser.add_argument("--out", type=Path, default=ROOT / "dashboards" / "json")
args = parser.parse_args()
for path in render.write(args.out, yaml.safe_load(args.config.read_text())):
    print(path)
sys.exit(0)
