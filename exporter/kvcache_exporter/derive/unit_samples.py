"""The group model's counts (derive/units.py) -> samples. Pure."""

from __future__ import annotations

from .. import catalog as c
from ..samples import Sample
from .units import BASE, UnitView


def unit_samples(view: UnitView, block_bytes: float | None = None) -> list[Sample]:
    totals = view.totals
    out = [
        Sample(
            c.KV_EVENTS_GROUP_INFO,
            {
                "group": "" if group is None else str(group),
                "kind": spec.kind or "",
                "sliding_window": "" if spec.window is None else str(spec.window),
                "block_size": ",".join(map(str, sorted(spec.block_sizes))),
            },
            1,
        )
        for group, spec in view.groups.items()
    ]
    if view.hit_unit:
        out.append(Sample(c.KV_EVENTS_HIT_UNIT_TOKENS, {}, view.hit_unit))
    stored = view.by_adapter.counts or {BASE: 0}
    out += [Sample(c.KV_EVENTS_STORED_TOKENS_TOTAL, {"adapter": a}, n) for a, n in stored.items()]
    reused = view.reused_by_adapter.counts or {BASE: 0}
    out += [Sample(c.KV_EVENTS_REUSED_TOKENS_TOTAL, {"adapter": a}, n) for a, n in reused.items()]
    for kind, counts in (("stored", view.by_session.counts), ("reused", view.reused_by_session.counts)):
        out += [
            Sample(c.KV_EVENTS_SESSION_TOKENS_TOTAL, {"session": s, "kind": kind}, n)
            for s, n in counts.items()
        ]
    if totals.stored_tokens:
        out.append(Sample(c.KV_EVENTS_SESSION_ID_RATIO, {}, totals.session_tokens / totals.stored_tokens))
    out.append(Sample(c.KV_EVENTS_WINDOW_EVICTIONS_TOTAL, {}, totals.window_evictions))
    for medium, held in view.tiers.items():
        out.append(Sample(c.KV_EVENTS_TIER_BLOCKS, {"medium": medium}, len(held)))
        if block_bytes:
            out.append(Sample(c.KV_EVENTS_TIER_BYTES, {"medium": medium}, len(held) * block_bytes))
    for medium, tokens in totals.tier_hit_tokens.items():
        out.append(Sample(c.KV_EVENTS_TIER_HIT_TOKENS_TOTAL, {"medium": medium}, tokens))
    return out
