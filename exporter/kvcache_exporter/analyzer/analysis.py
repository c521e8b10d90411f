"""Why does a prompt workload miss the prefix cache? Pure functions over a trace.

The cache itself is not modelled here: every hit ratio comes from replaying the requests through the
simulator's engine (`kvcache_exporter.simulator.engine`, vLLM V1's scheduler over its block pool).
Replays are sequential per replica by default (each request runs to completion before the next one on
that replica starts: how the seed trace was recorded, the least cache pressure a real run can have), or
overlapping with `concurrency` / `speed` (replay.concurrent_replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .curvereport import render_curve
from .replay import Replay, blocks_needed_unbounded, concurrent_replay, replay
from .structure import Structure, _template_offsets, structure
from .trace import TraceRequest

SIGNIFICANT = 0.05
"""Hit-ratio points below which a loss is not worth a diagnosis."""


@dataclass
class Diagnosis:
    kind: str
    """dynamic_prefix | nothing_shared | capacity | affinity | block_granularity"""
    title: str
    gain: float
    """hit-ratio points the remedy would recover (measured by a replay where possible)"""
    evidence: str
    remedies: list[str]


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
    """same cache, dynamic part moved behind the template (only with a dynamic field)"""
    capacity_blocks_needed: int | None
    structure: Structure
    diagnoses: list[Diagnosis]
    notes: list[str]
    curve: dict | None = None
    """the miss-ratio curve and misses by cause (mrc.Curve.to_dict), filled in by the caller"""

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("observed", "unbounded", "one_replica", "session_routing", "dynamic_moved_last"):
            if out[key] is not None:
                out[key].pop("per_request_hits", None)
        return out


def move_dynamic_last(requests: Sequence[TraceRequest], block_size: int) -> list[TraceRequest]:
    """The same requests with everything before their shared template moved to the end."""
    offsets, _ = _template_offsets([r.prompt_token_ids for r in requests])
    out = []
    for r, o in zip(requests, offsets, strict=True):
        p = r.prompt_token_ids
        moved = p[o:] + p[:o] if o else list(p)
        out.append(TraceRequest(moved, r.max_tokens, r.session, r.send_ts, r.forced_output, r.index))
    return out


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
) -> Report:
    """Sequential replays unless `concurrency` (closed loop) or `speed` (open loop at the trace's send_ts)
    is given; then every replay runs that way."""
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
    shape = structure(requests, bs)
    diagnoses: list[Diagnosis] = []
    notes: list[str] = []
    moved = None

    dyn = shape.dynamic_field
    if dyn is not None and shape.first_block_unique_share >= 0.5:
        moved = run(move_dynamic_last(requests, bs), bs, num_gpu_blocks, replicas, routing, max_model_len)
        diagnoses.append(
            Diagnosis(
                "dynamic_prefix",
                "dynamic prefix at the front: per-request fields come before the shared template",
                moved.hit_ratio - observed.hit_ratio,
                f"{shape.first_block_unique_share:.0%} of the requests have a first block no other request "
                f"has; "
                f"{dyn.requests} requests differ at token {dyn.start}-{dyn.end} "
                f"(median {dyn.median_len:g} tokens) then share {dyn.template_tokens} tokens. "
                f"Replayed with that part moved to the end: hit ratio {observed.hit_ratio:.3f} -> "
                f"{moved.hit_ratio:.3f}.",
                [
                    "move the dynamic header (user id, timestamps, order numbers, request ids) after the "
                    "static "
                    "template: system prompt and instructions first, per-request data last",
                    "keep the static part byte-identical between requests (no timestamps or ids inside it)",
                ],
            )
        )
    elif shape.first_block_unique_share >= 0.9 and unbounded.hit_ratio < SIGNIFICANT:
        diagnoses.append(
            Diagnosis(
                "nothing_shared",
                "the prompts share nothing: no template recurs across requests",
                0.0,
                f"{shape.first_block_unique_share:.0%} of first blocks are unique and even an unbounded "
                f"cache "
                f"hits {unbounded.hit_ratio:.3f}.",
                [
                    "prefix caching cannot help this workload; check whether a common system prompt was "
                    "expected"
                ],
            )
        )

    capacity_loss = unbounded.hit_ratio - observed.hit_ratio
    needed = None
    if capacity_loss >= SIGNIFICANT:
        needed = _blocks_for(requests, unbounded.hit_ratio, bs, num_gpu_blocks, replicas, routing, run)
        diagnoses.append(
            Diagnosis(
                "capacity",
                "KV cache too small: shared blocks are evicted before they are reused",
                capacity_loss,
                f"hit ratio {observed.hit_ratio:.3f} with {num_gpu_blocks} blocks per replica vs "
                f"{unbounded.hit_ratio:.3f} with no eviction ({capacity_loss:+.3f} measured); about "
                f"{needed} blocks per replica ({needed * bs} tokens) reach it. Preemptions: "
                f"{observed.preemptions}.",
                [
                    "raise KV capacity: a higher gpu_memory_utilization (or --kv-cache-memory-bytes)",
                    "fewer concurrent sequences (max_num_seqs) or a shorter max_model_len leave more blocks "
                    "for cached prefixes",
                    "an fp8 KV cache (kv_cache_dtype=fp8) doubles the blocks in the same memory",
                    "or spread the load over more replicas with prefix-aware routing",
                ],
            )
        )

    if one is not None:
        affinity_loss = one.hit_ratio - unbounded.hit_ratio
        if affinity_loss >= SIGNIFICANT:
            session_text = ""
            if by_session is not None:
                session_text = f" Routing by session instead: {by_session.hit_ratio:.3f}."
            diagnoses.append(
                Diagnosis(
                    "affinity",
                    "session affinity broken: requests that share a prefix land on different replicas",
                    affinity_loss,
                    f"{replicas} replicas with {routing} routing hit {unbounded.hit_ratio:.3f} even without "
                    f"eviction; one replica would hit {one.hit_ratio:.3f} ({affinity_loss:+.3f})."
                    f"{session_text}",
                    [
                        "enable session affinity (route by user/session id: a consistent hash, sticky "
                        "sessions)",
                        "or prefix-aware routing (a router that hashes the prompt's leading blocks or "
                        "follows "
                        "the replicas' KV events)",
                    ],
                )
            )

    if shape.block_granularity_loss >= SIGNIFICANT:
        diagnoses.append(
            Diagnosis(
                "block_granularity",
                "shared prefixes end inside blocks: only whole blocks are reused",
                shape.block_granularity_loss,
                f"{shape.block_granularity_loss:.1%} of prompt tokens are shared with an earlier request but "
                f"sit in a partly shared block of {bs} tokens.",
                [
                    "a smaller --block-size shares more of each prefix (more blocks, more metadata); "
                    "block size "
                    "is tokens per block and does not need to match the model's layer count",
                    "or pad the static template to a multiple of the block size",
                ],
            )
        )
    diagnoses.sort(key=lambda d: -d.gain)
    notes.append(
        f"block size {bs} is tokens per KV block (a cache hit is counted in whole blocks); it does not "
        "need to "
        "match the model's layer count."
    )
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
    return Report(settings, observed, unbounded, one, by_session, moved, needed, shape, diagnoses, notes)


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
        "",
        "hit ratio (prompt tokens served from the prefix cache)",
        f"  observed (this cache)           {report.observed.hit_ratio:6.3f}",
        f"  unbounded cache                 {report.unbounded.hit_ratio:6.3f}",
    ]
    if report.one_replica is not None:
        lines.append(f"  one replica, unbounded          {report.one_replica.hit_ratio:6.3f}")
    if report.session_routing is not None:
        lines.append(f"  routing by session              {report.session_routing.hit_ratio:6.3f}")
    if report.dynamic_moved_last is not None:
        lines.append(f"  dynamic part moved last         {report.dynamic_moved_last.hit_ratio:6.3f}")
    st = report.structure
    lines += [
        "",
        "prefix structure",
        f"  first block unique in           {st.first_block_unique_share:6.1%} of requests",
        f"  tokens lost to partial blocks   {st.block_granularity_loss:6.1%}",
    ]
    for p in st.shared_prefixes:
        head = " ".join(map(str, p.head)) + (" ..." if p.tokens > len(p.head) else "")
        lines.append(f"  shared prefix {p.tokens:5d} tokens by {p.requests:4d} requests: [{head}]")
    if st.dynamic_field is not None:
        d = st.dynamic_field
        lines.append(
            f"  dynamic field: requests differ at token {d.start}-{d.end} (median {d.median_len:g} tokens) "
            f"then share {d.template_tokens} tokens ({d.requests} requests)"
        )
    lines += ["", "diagnosis"]
    if not report.diagnoses:
        lines.append("  no significant cache loss found")
    for n, d in enumerate(report.diagnoses, 1):
        lines.append(f"  {n}. [{d.kind}] {d.title} (+{d.gain:.3f} hit ratio)")
        lines.append(f"     {d.evidence}")
        lines += [f"     - {r}" for r in d.remedies]
    if report.curve is not None:
        lines += render_curve(report.curve, s["num_gpu_blocks"], s["block_size"])
    lines += ["", *[f"note: {n}" for n in report.notes]]
    return "\n".join(lines) + "\n"
