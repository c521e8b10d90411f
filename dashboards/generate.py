"""Write every dashboard as JSON (sorted keys, indent 2) into dashboards/json/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python dashboards/generate.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards import cache, common, gpu_cost, overview

MODULES = (overview, cache, gpu_cost)
OUT = Path(__file__).resolve().parent / "json"


def render(module) -> str:
    board = module.build().build()
    for number, panel in enumerate(_all_panels(board.panels or []), start=1):
        panel.id_val = number  # stable ids, so alerts can link to `viewPanel=<id>`
    return JSONEncoder(sort_keys=True, indent=2).encode(board) + "\n"


def _all_panels(panels):
    for panel in panels:
        yield panel
        yield from _all_panels(getattr(panel, "panels", None) or [])


def write(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for module in MODULES:
        path = out / f"{module.UID}.json"
        path.write_text(render(module))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT, help="output directory (default: %(default)s)")
    parser.add_argument("--runbook-url", default=common.RUNBOOK_URL, help="where docs/runbook.md is served")
    args = parser.parse_args(argv)
    common.RUNBOOK_URL = args.runbook_url
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
