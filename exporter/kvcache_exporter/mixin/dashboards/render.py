"""Every dashboard as JSON (sorted keys, indent 2), with the limits of the mixin's config."""

from __future__ import annotations

from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from ..thresholds import DashboardThresholds
from . import cache, fleet, gpu_cost, overview
from .common import LIMITS

MODULES = (overview, cache, gpu_cost, fleet)


def render(module, cfg: dict) -> str:
    token = LIMITS.set(DashboardThresholds.of(cfg))
    try:
        board = module.build().build()
    finally:
        LIMITS.reset(token)
    for number, panel in enumerate(_all_panels(board.panels or []), start=1):
        panel.id_val = number  # stable ids, so alerts can link to `viewPanel=<id>`
    return JSONEncoder(sort_keys=True, indent=2).encode(board) + "\n"


def _all_panels(panels):
    for panel in panels:
        yield panel
        yield from _all_panels(getattr(panel, "panels", None) or [])


def render_all(cfg: dict) -> dict[str, str]:
    """{file name: JSON text} of every dashboard."""
    return {f"{module.UID}.json": render(module, cfg) for module in MODULES}


def write(out: Path, cfg: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_all(cfg).items():
        path = out / name
        path.write_text(text)
        paths.append(path)
    return paths
