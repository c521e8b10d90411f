"""Why does a prompt workload miss the prefix cache? Pure functions over a trace.

The cache itself is not modelled here: every hit ratio comes from replaying the requests through the
simulator's engine (`kvcache_exporter.simulator.engine`, vLLM V1's scheduler over its block pool).
Replays are sequential per replica by default (each request runs to completion before the next one on
that replica starts: how the seed trace was recorded, the least cache pressure a real run can have), or
overlapping with `concurrency` / `speed` (replay.concurrent_replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from . import hosttier, live, reorder
from .curvereport import ASSUMED, assumed_notes, render_curve, render_diagnoses, render_units
from .diagnoses import SIGNIFICANT, Diagnosis, diagnose
from .replay import Replay, blocks_needed_unbounded, concurrent_replay, replay
from .structure import Structure, structure
from .trace import TraceRequest


@dataclass
class Report:
    settings: dict
    observed: Replay
    unbounded: Replay
    """same replicas and routing, no eviction"""
    one_replica: Replay | None
    """one replica with no eviction (only when replicas > 1)"""
    session_routing: Replay | None
    """same cache, routing by session (only when replicas > 1 and routing is round-robin)"""
    dynamic_moved_last: Replay | None
    """same cache, each request's per-request part moved to the very end (reorder.py; only when some
    request has one)"""
    capacity_blocks_needed: int | None
    structure: Structure
    diagnoses: list[Diagnosis]
    notes: list[str]
    curve: dict | None = None
    """the miss-ratio curve and misses by cause (mrc.Curve.to_dict), filled in by the caller"""
    reordered_estimate: float | None = None
    """the sidecar's estimate of the reorder (observed hits + the curve's prefix_diverged tokens), beside the
    exact replay `dynamic_moved_last`"""
    misses_by_cause: dict[str, int] | None = None
    """computed prompt tokens by cause, by serve's own rule on the replayed stream (live.py; sequential)"""
    layout_estimates: dict[str, float | None] | None = None
    """the sidecar's estimate of the reorder per layout (derive/layouts.py), filled in by the caller"""
    dynamic_moved_after_template: Replay | None = None
    """the same, the per-request part moved right after the shared template instead (before what follows)"""
    units: list[dict] | None = None
    """hit ratio with no eviction per hit unit (hitunit.unit_rows), filled in by the caller"""
    host_tier: dict | None = None
    """the exact two-tier replay with a host tier (hosttier.HostTier.to_dict; only when one is asked for)"""

    def to_dict(self) -> dict:
        out = asdict(self)
        keys = ("observed", "unbounded", "one_replica", "session_routing", "dynamic_moved_last")
        for key in (*keys, "dynamic_moved_after_template"):
            if out[key] is not None:
                out[key].pop("per_request_hits", None)
        return out


def reordered(requests: Sequence[TraceRequest], layouts, move=reorder.reorder) -> list[TraceRequest]:
    """The same requests with their per-request part moved (`move`: to the end, or after the template)."""
    return [
        replace(r, prompt_token_ids=move(r.prompt_token_ids, lay))
        for r, lay in zip(requests, layouts, strict=True)
    ]


def _blocks_for(
    requests: Sequence[TraceRequest], target: float, bs: int, start: int, replicas: int, routing: str, run
) -> int:
    """About the fewest blocks per replica whose hit ratio is within 1 point of `target` (doubling `start`,
    then bisecting to within 5%)."""
    limit = blocks_needed_unbounded(requests, bs)

    def enough(blocks: int) -> bool:
        return run(requests, bs, blocks, replicas, routing).hit_ratio >= target - 0.01

    low, high = start, start
    while high < limit and not enough(high):
        low, high = high, min(high * 2, limit)
    while high - low > max(1, high // 20):
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high


def analyze(
    requests: Sequence[TraceRequest],
    block_size: int,
    num_gpu_blocks: int,
    replicas: int = 1,
    routing: str = "round-robin",
    max_model_len: int | None = None,
    restarts: frozenset[int] = frozenset(),
    concurrency: int | None = None,
    speed: float | None = None,
    decode=None,
    host_tier: tuple[int, float | None] | None = None,
) -> Report:
    """Sequential replays unless `concurrency` (closed loop) or `speed` (open loop at the trace's send_ts)
    is given; then every replay runs that way. `host_tier`: (blocks per replica, KV bytes per token or
    None) for the exact two-tier replay (sequential, whatever the other replays do)."""
    if not requests:
        raise ValueError("empty trace")
    bs = block_size
    overlapping = concurrency is not None or speed is not None

    def run(reqs, bs, blocks, replicas, routing, max_model_len=None, restarts=frozenset()):
        if overlapping:
            return concurrent_replay(
                reqs, bs, blocks, replicas, routing, max_model_len, concurrency, speed, restarts
            )
        return replay(reqs, bs, blocks, replicas, routing, max_model_len, restarts)

    unbounded_blocks = blocks_needed_unbounded(requests, bs)
    observed = run(requests, bs, num_gpu_blocks, replicas, routing, max_model_len, restarts)
    unbounded = run(requests, bs, unbounded_blocks, replicas, routing, max_model_len, restarts)
    one = run(requests, bs, unbounded_blocks, 1, routing, max_model_len) if replicas > 1 else None
    by_session = None
    if replicas > 1 and routing == "round-robin" and any(r.session for r in requests):
        by_session = run(requests, bs, num_gpu_blocks, replicas, "session", max_model_len)
    layouts = reorder.layouts([r.prompt_token_ids for r in requests], bs)
    shape = structure(requests, bs, layouts, decode)
    seen = live.live_view(requests, bs, num_gpu_blocks, replicas, routing, max_model_len, restarts, decode)
    if shape.dynamic_field is not None and seen.field is not None:  # named as serve names it
        shape.dynamic_field.field, shape.dynamic_field.shape = seen.field
    moved = after = None
    if any(layouts):
        moved = run(reordered(requests, layouts), bs, num_gpu_blocks, replicas, routing, max_model_len)
        after_template = reordered(requests, layouts, reorder.reorder_after_template)
        after = run(after_template, bs, num_gpu_blocks, replicas, routing, max_model_len)
    needed = None
    if unbounded.hit_ratio - observed.hit_ratio >= SIGNIFICANT:
        needed = _blocks_for(requests, unbounded.hit_ratio, bs, num_gpu_blocks, replicas, routing, run)
    tier = None
    if host_tier is not None:
        blocks, per_token = host_tier
        tier = hosttier.two_tier_replay(requests, bs, num_gpu_blocks, blocks, replicas, routing, per_token)
    found = facts(
        bs, num_gpu_blocks, replicas, routing, observed, unbounded, one, by_session, moved, needed, shape
    )
    found["host_text"] = hosttier.evidence(None if tier is None else tier.to_dict())
    diagnoses = diagnose(found)
    notes = [
        f"block size {bs} is tokens per KV block (a cache hit is counted in whole blocks); it does not need "
        "to match the model's layer count."
    ]
    if observed.rejected:
        notes.append(f"{observed.rejected} requests never fit the pool or max_model_len and were skipped")
    if observed.preemptions:
        notes.append(f"{observed.preemptions} preemptions in the observed replay")
    settings = {
        "block_size": bs,
        "num_gpu_blocks": num_gpu_blocks,
        "replicas": replicas,
        "routing": routing,
        "requests": len(requests),
        "replay": replay_mode(concurrency, speed),
    }
    report = Report(settings, observed, unbounded, one, by_session, moved, needed, shape, diagnoses, notes)
    report.host_tier = None if tier is None else tier.to_dict()
    report.dynamic_moved_after_template = after
    report.misses_by_cause = seen.misses_by_cause
    report.reordered_estimate = seen.reordered_estimate
    report.layout_estimates = {layout: seen.layout_estimate(layout) for layout in seen.reorder_tokens}
    return report


def facts(bs, num_gpu_blocks, replicas, routing, observed, unbounded, one, by_session, moved, needed, shape):
    """What the diagnoses (diagnoses.CAUSES) may test and cite."""
    dyn = shape.dynamic_field
    return {
        "block_size": bs,
        "num_gpu_blocks": num_gpu_blocks,
        "replicas": replicas,
        "routing": routing,
        "observed": observed.hit_ratio,
        "unbounded": unbounded.hit_ratio,
        "one_replica": None if one is None else one.hit_ratio,
        "session_text": "" if by_session is None else f" Routing by session: {by_session.hit_ratio:.3f}.",
        "reordered": None if moved is None else moved.hit_ratio,
        "needed_blocks": needed,
        "needed_text": needed and f"about {needed} blocks per replica ({needed * bs} tokens)",
        "preemptions": observed.preemptions,
        "first_block_unique": shape.first_block_unique_share,
        "granularity_loss": shape.block_granularity_loss,
        "dyn_requests": dyn and dyn.requests,
        "dyn_start": dyn and dyn.start,
        "dyn_where": dyn
        and (
            "from the first token"
            if dyn.start == 0
            else f"from token {dyn.start} on (after the first {dyn.start} token{'s' * (dyn.start > 1)}, which"
            " at least half the requests share: a chat template's role header, a field label)"
        ),
        "dyn_end": dyn and dyn.end,
        "dyn_len": dyn and dyn.median_len,
        "dyn_template": dyn and dyn.template_tokens,
        "dyn_field_text": f" The first per-request field reads as {_a(dyn.field)} ({dyn.shape})."
        if dyn and dyn.field
        else "",
    }


def _moved_lines(moved: Replay | None, observed: float) -> list[str]:
    """The reorder's exact replay; below the observed ratio it is no remedy, and the line says why."""
    if moved is None:
        return []
    if moved.hit_ratio >= observed:
        return [f"  per-request part moved to end   {moved.hit_ratio:6.3f}  (exact replay)"]
    return [
        f"  per-request part moved to end   no gain: its replay reads {moved.hit_ratio:.3f}, below this "
        f"cache's {observed:.3f} (what reads as a per-request part already follows the shared content: "
        "moving it further splits content the requests share)"
    ]


def _layout_lines(report: Report) -> list[str]:
    """The sidecar's estimate per layout (live.py) beside the exact replays; after the template only where
    the two layouts differ."""
    live, end, after = (
        report.layout_estimates or {},
        report.dynamic_moved_last,
        report.dynamic_moved_after_template,
    )
    lines = []
    if live.get("end") is not None:
        name = "    estimated live              " if end is not None else "  moved to end, estimated live  "
        lines.append(f"{name}  {live['end']:6.3f}  (prefix_diverged reached in order)")
    differ = after is not None and end is not None and abs(after.hit_ratio - end.hit_ratio) >= 0.0005
    if differ or (live.get("after_template") is not None and live["after_template"] != live.get("end")):
        if after is not None:
            lines.append(f"  ... moved after the template    {after.hit_ratio:6.3f}  (exact replay)")
        if live.get("after_template") is not None:
            lines.append(
                f"    estimated live                {live['after_template']:6.3f}  (up to the template's end)"
            )
    if report.reordered_estimate is not None:
        lines.append(
            f"  known content behind fields     {report.reordered_estimate:6.3f}  (hits + prefix_diverged)"
        )
    return lines


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _clip(text: str, keep: int = 120) -> str:
    return text if len(text) <= keep else text[: keep // 2] + " ... " + text[-keep // 2 :]


def replay_mode(concurrency: int | None, speed: float | None) -> str:
    if concurrency is not None:
        return f"closed loop, {concurrency} clients"
    if speed is not None:
        return f"open loop at the trace's arrivals x{speed:g}"
    return "sequential per replica"


def render_text(report: Report) -> str:
    s = report.settings
    lines = [
        f"trace: {s['requests']} requests; block size {s['block_size']}, {s['num_gpu_blocks']} blocks per "
        f"replica, {s['replicas']} replica(s), {s['routing']} routing ({s['replay']})",
        *assumed_notes(report.notes),
        "",
        "hit ratio (prompt tokens served from the prefix cache)",
        f"  observed (this cache)           {report.observed.hit_ratio:6.3f}",
        f"  unbounded cache                 {report.unbounded.hit_ratio:6.3f}",
    ]
    if report.one_replica is not None:
        lines.append(f"  one replica, unbounded          {report.one_replica.hit_ratio:6.3f}")
    if report.session_routing is not None:
        lines.append(f"  routing by session              {report.session_routing.hit_ratio:6.3f}")
    lines += _moved_lines(report.dynamic_moved_last, report.observed.hit_ratio)
    lines += _layout_lines(report)
    lines += hosttier.render_text(report.host_tier)
    st = report.structure
    lines += [
        "",
        "prefix structure",
        f"  first block unique in           {st.first_block_unique_share:6.1%} of requests",
        f"  tokens lost to partial blocks   {st.block_granularity_loss:6.1%}",
    ]
    for p in st.shared_prefixes:
        head = " ".join(map(str, p.head)) + (" ..." if p.tokens > len(p.head) else "")
        shown = f"[{head}]" if p.text is None else repr(_clip(p.text))
        lines.append(f"  shared prefix {p.tokens:5d} tokens by {p.requests:4d} requests: {shown}")
    if st.dynamic_field is not None:
        d = st.dynamic_field
        lines.append(
            f"  per-request part: requests differ at token {d.start}-{d.end} (shared content from token "
            f"{d.median_len:g}, median) then share {d.template_tokens} tokens ({d.requests} requests)"
        )
        if d.field is not None:
            lines.append(f"  first per-request field: {d.field}   {_clip(d.shape or '')}")
    lines += render_diagnoses([asdict(d) for d in report.diagnoses], report.observed.hit_ratio)
    if report.curve is not None:
        lines += render_curve(report.curve, s["num_gpu_blocks"], s["block_size"])
    lines += render_units(report.units)
    lines += ["", *[f"note: {n}" for n in report.notes if not n.startswith(ASSUMED)]]
    return "\n".join(lines) + "\n"
