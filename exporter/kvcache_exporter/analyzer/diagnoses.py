"""The analyzer's diagnoses as data: cause, when it holds, the hit ratio its fix reaches, evidence, actions.

Every figure a diagnosis cites is a fact of the analysis (analysis.facts): hit ratios of replays, never
estimates made here. A diagnosis is worth `after - observed` hit-ratio points; they are ranked by worth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SIGNIFICANT = 0.05
"""Hit-ratio points below which a loss is not worth a diagnosis."""


@dataclass(frozen=True)
class Cause:
    kind: str
    title: str
    holds: Callable[[dict], bool]
    after: Callable[[dict], float]
    """the hit ratio once fixed (a replay of the fixed trace where one exists)"""
    evidence: str
    """str.format over the facts"""
    actions: tuple[str, ...]
    always: bool = False
    """reported even when worth nothing (a finding, not a loss)"""


@dataclass
class Diagnosis:
    kind: str
    title: str
    gain: float
    """hit-ratio points the fix recovers: its worth"""
    after: float
    """the hit ratio with the fix"""
    evidence: str
    remedies: list[str]


CAUSES = (
    Cause(
        "dynamic_prefix",
        "per-request fields come before the shared content",
        lambda f: f["reordered"] is not None,
        lambda f: f["reordered"],
        "{dyn_requests} requests differ {dyn_where} up to the shared content (at token {dyn_len:g}, median), "
        "then carry {dyn_template} tokens of it. Replayed with the "
        "per-request part moved after the shared content: hit ratio {observed:.3f} -> {reordered:.3f}."
        "{dyn_field_text}",
        (
            "move the per-request fields (timestamp, customer or user id, order number, request id) after "
            "the shared content: system prompt and instructions first, per-request data last",
            "keep the shared part byte-identical between requests (no timestamps or ids inside it)",
        ),
    ),
    Cause(
        "nothing_shared",
        "the prompts share nothing: no content recurs across requests",
        lambda f: f["first_block_unique"] >= 0.9 and max(f["unbounded"], f["reordered"] or 0) < SIGNIFICANT,
        lambda f: f["observed"],
        "{first_block_unique:.0%} of first blocks are unique and even an unbounded cache hits "
        "{unbounded:.3f}.",
        ("prefix caching cannot help this workload; check whether a common system prompt was expected",),
        always=True,
    ),
    Cause(
        "capacity",
        "KV cache too small: shared blocks are evicted before they are reused",
        lambda f: f["needed_blocks"] is not None,
        lambda f: f["unbounded"],
        "hit ratio {observed:.3f} with {num_gpu_blocks} blocks per replica vs {unbounded:.3f} with no "
        "eviction; {needed_text} reach it.{host_text} "
        "Preemptions: {preemptions}.",
        (
            "raise KV capacity: a higher gpu_memory_utilization (or --kv-cache-memory-bytes)",
            "fewer concurrent sequences (max_num_seqs) or a shorter max_model_len leave more blocks for "
            "cached prefixes",
            "an fp8 KV cache (kv_cache_dtype=fp8) doubles the blocks in the same memory",
            "or spread the load over more replicas with prefix-aware routing",
            "or a host (CPU) KV tier (vLLM's --kv-offloading-size): evicted blocks are loaded back, not "
            "recomputed",
        ),
    ),
    Cause(
        "affinity",
        "session affinity broken: requests that share a prefix land on different replicas",
        lambda f: f["one_replica"] is not None,
        lambda f: f["observed"] + f["one_replica"] - f["unbounded"],
        "{replicas} replicas with {routing} routing hit {unbounded:.3f} even without eviction; one replica "
        "would hit {one_replica:.3f}.{session_text}",
        (
            "enable session affinity (route by user/session id: a consistent hash, sticky sessions)",
            "or prefix-aware routing (a router that hashes the prompt's leading blocks or follows the "
            "replicas' KV events)",
        ),
    ),
    Cause(
        "block_granularity",
        "shared prefixes end inside blocks: only whole blocks are reused",
        lambda f: True,
        lambda f: f["observed"] + f["granularity_loss"],
        "{granularity_loss:.1%} of prompt tokens are shared with an earlier request but sit in a partly "
        "shared block of {block_size} tokens.",
        (
            "a smaller --block-size shares more of each prefix (more blocks, more metadata); block size is "
            "tokens per block and does not need to match the model's layer count",
            "or pad the shared template to a multiple of the block size",
        ),
    ),
)


def diagnose(facts: dict) -> list[Diagnosis]:
    """The causes that hold, worth at least SIGNIFICANT (or always reported), best worth first."""
    out = []
    for cause in CAUSES:
        if not cause.holds(facts):
            continue
        after = cause.after(facts)
        worth = after - facts["observed"]
        if worth >= SIGNIFICANT or cause.always:
            evidence = cause.evidence.format(**facts)
            out.append(Diagnosis(cause.kind, cause.title, worth, after, evidence, list(cause.actions)))
    out.sort(key=lambda d: -d.gain)
    return out
