"""kvcache-overview: the on-call view. Is the KV cache healthy right now?"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import units

from .common import (
    RATE,
    WINDOW,
    Query,
    above_is_bad,
    below_is_bad,
    dashboard,
    graph,
    grid,
    limits,
    rate,
    sel,
    single,
)

UID = "kvcache-overview"
FIRING = 'ALERTS{alertname=~"KVCache.*", alertstate="firing"}'
P99 = 'quantile="0.99"'
LATENCY_ALERTS = ("KVCacheTimeToFirstTokenSLOBurn", "KVCachePrefillLatencySLOBurn")
HIT_ALERTS = ("KVCacheHitRatioBelowFloor", "KVCacheHitRatioDropped")
MEMORY_ALERTS = ("KVCacheGPUMemoryOverBudget", "KVCacheGPUMemorySwingLarge")
UP_ALERTS = ("KVCacheExporterDown", "KVCacheExporterAbsent", "KVCacheVLLMDown", "KVCacheCollectorFailing")
CAUSE_ALERTS = (
    "KVCacheMissesFromDivergedPrefix",
    "KVCacheEvictionThrashing",
    "KVCacheAffinityLoss",
    "KVCacheMissesFromRewrittenHistory",
    "KVCacheMissesFromMovedContent",
    "KVCacheMissesFromExpiredWindows",
    "KVCacheSharedContentBelowHitUnit",
)
MISSES = "kvcache_prefix_cache_miss_tokens_total"
NO_REPLICA, TWICE = 'replica=""', 'capacity_factor="2"'  # the sidecar's series; the 2x estimate
ACTIONS = {  # docs/runbook.md, per cause of kvcache_prefix_cache_miss_tokens_total (attribution.CAUSES)
    "prefix_diverged": "move the per-request fields after the shared part",
    "evicted": "the cache is too small: more KV memory, a host tier, fewer sequences",
    "window_expired": "set vLLM's --prefix-cache-retention-interval: window parts are dropped before reuse",
    "restart": "vLLM restarted: the cache is warming up",
    "other_replica": "route requests that share a prefix to the same replica",
    "history_rewritten": "make the chat template reproduce the generated turns verbatim",
    "content_moved": "sort tools/documents deterministically",
    "below_hit_unit": "make the shared part at least one hit unit long",
    "identity_isolated": "another LoRA adapter or cache_salt: isolated by design",
    "cold": "new content: nothing to share yet",
}


def _top_cause() -> str:
    """The cause with the largest share of the miss tokens, labelled with its `action`."""
    misses = f"sum by (cause) (rate({sel(MISSES, NO_REPLICA)}[{RATE}]))"
    expr = f"topk(1, {misses} / ignoring(cause) group_left() (sum({misses}) > 0))"
    for cause, action in ACTIONS.items():
        expr = f'label_replace({expr}, "action", "{action}", "cause", "{cause}")'
    return expr


def _why():
    """The on-call's why: the top cause, its share and action; what each fix is worth."""
    estimate = "kvcache_prefix_cache_hit_ratio_estimate"
    return [
        single(
            "Why the cache misses",
            Query(_top_cause(), "{{cause}}: {{action}}"),
            shows="The cause of most prompt tokens vLLM computed (KV events), its share of them, and the "
            "action that addresses it.",
            action="Do what the panel says; the next panel says what it is worth. Open the deep dive's "
            "'Why is the cache missing?' row for the evidence.",
            alerts=CAUSE_ALERTS,
            unit=units.PercentUnit,
            w=12,
            named=True,
        ),
        single(
            "What each fix is worth (hit ratio)",
            Query(f"avg({sel('kvcache_prefix_cache_hit_ratio', WINDOW)})", "now"),
            Query(
                f"max({sel('kvcache_prefix_cache_hit_ratio_reordered_estimate', WINDOW)})",
                "per-request fields after the shared part",
            ),
            Query(f"max({sel(estimate, WINDOW, TWICE)})", "2x KV cache"),
            Query(f"max({sel('kvcache_prefix_cache_hit_ratio_host_tier_estimate', WINDOW)})", "host tier"),
            shows="The hit ratio now and the exporter's estimates over the $window window with each fix: "
            "the prompt reordered, twice the KV cache, the host tier of --whatif.host-tier-bytes.",
            action="The largest gain is the fix to make first; estimates are biased low (docs/kv-events.md).",
            alerts=CAUSE_ALERTS[:2],
            unit=units.PercentUnit,
            w=12,
            named=True,
        ),
    ]


def _sla(name: str, label: str, default: float) -> db.TextBoxVariable:
    return db.TextBoxVariable(name).label(label).default_value(f"{default:g}")


def _stats():
    hit, lim = sel("kvcache_prefix_cache_hit_ratio"), limits()
    return [
        single(
            "Prefix-cache hit ratio",
            Query(f"min by (window) ({hit})", "{{window}}"),
            shows="Lowest hit ratio across the selected models, per window; "
            f"red below {lim.hit_ratio_floor:g}.",
            action="Open KV cache deep dive: a drop with steady traffic means prompts changed (template, "
            "dynamic fields first) or the cache is evicted (see block utilization, preemptions).",
            alerts=HIT_ALERTS,
            unit=units.PercentUnit,
            thresholds=below_is_bad(lim.hit_ratio_floor),
        ),
        single(
            "TTFT p99",
            Query(f"max({sel('kvcache_time_to_first_token_seconds', P99)})"),
            shows="Worst time-to-first-token p99 over the exporter's windows.",
            action="Compare with prefill p99: if prefill is fine, requests queue (saturation).",
            alerts=LATENCY_ALERTS[:1],
            unit=units.Seconds,
            thresholds=above_is_bad(lim.ttft_seconds),
        ),
        single(
            "Prefill p99",
            Query(f"max({sel('kvcache_prefill_latency_seconds', P99)})"),
            shows="Worst prefill-time p99 over the exporter's windows.",
            action="Prefill grows when the hit ratio falls (more tokens computed): check it first.",
            alerts=LATENCY_ALERTS[1:],
            unit=units.Seconds,
            thresholds=above_is_bad(lim.prefill_seconds),
        ),
        single(
            "KV block utilization",
            Query(f"max({sel('kvcache_block_utilization_ratio')})"),
            shows="Highest share of KV blocks held by running requests.",
            action="Near 100 % vLLM preempts requests: add replicas, lower max_num_seqs or raise "
            "gpu_memory_utilization.",
            alerts=("KVCacheSaturated",),
            unit=units.PercentUnit,
            thresholds=above_is_bad(lim.block_utilization),
        ),
        single(
            "GPU memory / budget",
            Query(f"max({sel('kvcache_gpu_memory_budget_usage_ratio')})"),
            shows="GPU memory in use over the budget vLLM was given (gpu_memory_utilization x total).",
            action="Above 100 % another process shares the GPU: find it in the GPU & cost dashboard.",
            alerts=MEMORY_ALERTS[:1],
            unit=units.PercentUnit,
            thresholds=above_is_bad(lim.memory_budget),
        ),
        single(
            "Targets up",
            Query(f"min({sel('up')})", "exporter"),
            Query(f"min({sel('kvcache_vllm_up')})", "vLLM"),
            shows="1 when Prometheus scrapes every exporter and every exporter reaches vLLM.",
            action="0 for the exporter: check the sidecar's logs and /healthz; 0 for vLLM: the engine is "
            "down or its /metrics URL is wrong.",
            alerts=UP_ALERTS[:3],
            thresholds=below_is_bad(1),
        ),
        grid(
            "Firing KV cache alerts",
            Query(FIRING),
            shows="Alerts of this project that fire now, with their labels.",
            action="Open each alert's runbook section (links on this panel and in the alert).",
            alerts=("KVCacheHitRatioBelowFloor", "KVCacheSaturated", "KVCacheExporterDown"),
            w=24,
            h=6,
        ),
    ]


def _graphs():
    lim = limits()
    latency = [
        Query(f"max by (model_name) ({sel(metric, P99)})", f"{{{{model_name}}}} {what} p99")
        for metric, what in (
            ("kvcache_time_to_first_token_seconds", "TTFT"),
            ("kvcache_prefill_latency_seconds", "prefill"),
        )
    ]
    return [
        graph(
            "Hit ratio per window",
            Query(sel("kvcache_prefix_cache_hit_ratio"), "{{model_name}}/{{engine}} {{window}}"),
            shows=f"Share of queried prompt tokens served from the prefix cache over each window; the "
            f"dashed line is the {lim.hit_ratio_floor:g} floor. Gaps mean the window saw no queries.",
            action="Short windows dip first; act when the long window crosses the floor. Check the deep "
            "dive's computed-vs-cached tokens and the config audit.",
            alerts=HIT_ALERTS,
            unit=units.PercentUnit,
            thresholds=below_is_bad(lim.hit_ratio_floor),
        ),
        graph(
            "TTFT and prefill p99 against the SLA",
            *latency,
            Query("vector($ttft_sla)", "TTFT SLA"),
            Query("vector($prefill_sla)", "prefill SLA"),
            shows="p99 of time to first token and of prefill per model (worst window), with the SLAs set "
            "in the dashboard's ttft_sla / prefill_sla boxes.",
            action="TTFT above the SLA with prefill below it is queueing (saturation); both above means "
            "prefill work grew (cache misses, longer prompts).",
            alerts=LATENCY_ALERTS,
            unit=units.Seconds,
        ),
        graph(
            "KV block utilization",
            Query(sel("kvcache_block_utilization_ratio"), "{{model_name}}/{{engine}}"),
            shows="Share of KV blocks held by running requests (evictable cached blocks count as free).",
            action=f"Sustained above {lim.block_utilization:.0%} evicts the prefix cache and preempts: "
            "scale out or cut concurrency.",
            alerts=("KVCacheSaturated",),
            unit=units.PercentUnit,
            thresholds=above_is_bad(lim.block_utilization),
        ),
        graph(
            "Preemptions",
            Query(rate("kvcache_preemptions_total"), "{{model_name}}"),
            shows="Requests preempted per second because KV blocks ran out.",
            action="Any sustained preemption wastes prefill work: see KV block utilization.",
            alerts=("KVCacheSaturated",),
            unit=units.OpsPerSecond,
        ),
        graph(
            "GPU memory against the budget",
            Query(sel("kvcache_gpu_memory_used_bytes"), "used gpu{{gpu}}"),
            Query(sel("kvcache_gpu_memory_budget_bytes"), "budget gpu{{gpu}}"),
            shows="GPU memory in use against the budget vLLM was given.",
            action="Used above budget: another process shares the GPU, or vLLM's budget is wrong.",
            alerts=MEMORY_ALERTS,
            unit=units.BytesIEC,
        ),
        graph(
            "Cost per million tokens ($currency)",
            Query(sel("kvcache_cost_per_million_tokens"), "{{token_kind}} {{window}}"),
            shows="GPU cost per million tokens, prompt vs generation, in kvcache_cost_info's currency.",
            action="Rises when throughput falls or misses add prefill work; see the GPU & cost dashboard.",
            alerts=(
                "KVCacheCostOverBudget",
                "KVCacheCostAboveBaseline",
            ),
        ),
    ]


def build() -> db.Dashboard:
    lim = limits()
    slas = (
        _sla("ttft_sla", "TTFT SLA (s)", lim.ttft_seconds),
        _sla("prefill_sla", "Prefill SLA (s)", lim.prefill_seconds),
    )
    rows = {"Now": _stats(), "Why": _why(), "Trends": _graphs()}
    return dashboard(UID, "KV cache / Overview", "On-call view: is vLLM's KV cache healthy now?", rows, slas)
