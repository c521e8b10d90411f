"""The alerting rules: expressions and texts. Numbers come from config.yaml as <placeholders>."""

from __future__ import annotations

# Level of the per-model rules: every label but `engine` (job, instance, pod, target, model_name).
LVL = "instance_model_name"
HIT = f"{LVL}:kvcache_prefix_cache_hit_tokens:rate"
QUERY = f"{LVL}:kvcache_prefix_cache_query_tokens:rate"
RATIO = f"{LVL}:kvcache_prefix_cache_hit:ratio_rate"
VALUE = "{{ $value | humanizePercentage }}"

WHERE = "{{ with $labels.pod }} (pod {{ . }}){{ end }}{{ with $labels.target }} (target {{ . }}){{ end }}"
MODEL = "{{ $labels.model_name }} on {{ $labels.instance }}" + WHERE
GPU = "GPU {{ $labels.gpu }} ({{ $labels.name }}) on {{ $labels.instance }}" + WHERE
EXTRA_COST = (
    '{{ with printf "max by(currency) (kvcache_cache_miss_extra_cost_per_hour{instance=%q} '
    '* on(job, instance) group_left(currency) kvcache_cost_info)" $labels.instance | query }}'
    '{{ with first . }} The exporter estimates the misses cost {{ value . | printf "%.2f" }} '
    '{{ label "currency" . }}/h extra.{{ end }}{{ end }}'
)


def pct(x: float) -> str:
    return f"{x:.0%}"


def num(x: float) -> str:
    return f"{round(x, 6):g}"


def hit_ratio(g) -> list[dict]:
    hr = g.cfg["hit_ratio"]
    w, base, off, tps = (
        hr["windows"][0],
        hr["baseline_window"],
        hr["baseline_offset"],
        hr["min_query_tokens_per_second"],
    )
    guard = f"and {QUERY}{w} > {tps}"
    baseline = f"({RATIO}{base} offset {g.d(off)})"
    return g.alert(
        "KVCacheHitRatioBelowFloor",
        f"{RATIO}{w} < <threshold>\n{guard}",
        "Prefix-cache hit ratio is below its floor.",
        f"The prefix-cache hit ratio of {MODEL} is {VALUE} over {w}, below the floor of <pct> "
        f"while it serves more than {tps} prompt tokens/s.{EXTRA_COST}",
        pct=lambda s: pct(s["threshold"]),
    ) + g.alert(
        "KVCacheHitRatioDropped",
        f"{RATIO}{w} < (1 - <relative_drop>) * {baseline}\n"
        f"and {RATIO}{w} < {baseline} - {hr['min_drop_points']}\n{guard}",
        "Prefix-cache hit ratio dropped well below its own recent baseline.",
        f"The prefix-cache hit ratio of {MODEL} fell to {VALUE} over {w}, more than <pct> below its "
        f"own ratio over the {base} that ended {off} ago.{EXTRA_COST}",
        pct=lambda s: pct(s["relative_drop"]),
    )


def latency_slo(g) -> list[dict]:
    slo, rules = g.cfg["slo"], []
    budget = 1 - slo["objective"]
    for key, lat in slo["latencies"].items():
        errors = f"{LVL}:{lat['histogram'].replace(':', '_')}:slo_error_ratio_rate"
        count = f"{LVL}:{lat['histogram'].replace(':', '_')}_count:rate"

        def burn(spec: dict, errors: str = errors, count: str = count) -> str:
            return "\nor\n".join(
                f"(\n  {errors}{p['long']} > {num(p['factor'] * budget)}\n  and {errors}{p['short']} > "
                f"{num(p['factor'] * budget)}\n  and {count}{p['long']} > {slo['min_requests_per_second']}\n)"
                for p in slo["burn_rates"][spec["severity"]]
            )

        rules += g.alert(
            f"KVCache{key}SLOBurn",
            "<burn>",
            f"{lat['histogram']} is burning its latency error budget fast.",
            f"{VALUE} of the requests to {MODEL} took longer than {lat['threshold_seconds']}s "
            f"({lat['histogram']}) over <windows>; the SLO allows {pct(budget)} (burn rate <factors>).",
            burn=burn,
            windows=lambda s: " and ".join(
                f"{p['long']}/{p['short']}" for p in slo["burn_rates"][s["severity"]]
            ),
            factors=lambda s: " or ".join(f"{p['factor']}x" for p in slo["burn_rates"][s["severity"]]),
        )
    return rules


def capacity(g) -> list[dict]:
    sat, mw = g.cfg["saturation"], g.cfg["memory"]["swing_window"]
    sw, gw = sat["window"], sat["growth_window"]
    return (
        g.alert(
            "KVCacheSaturated",
            f"{LVL}:kvcache_block_utilization:max_avg{sw} > <threshold>\nand (\n"
            f"  {LVL}:kvcache_preemptions:rate{gw} > <preemptions_per_second>\n"
            f"  or {LVL}:kvcache_requests_waiting:deriv{gw} > <waiting_growth_per_second>\n)",
            "KV cache is full and requests are preempted or queueing.",
            f"The KV cache of {MODEL} is {VALUE} in use (busiest engine, {sw} average) while requests are "
            f"preempted or the waiting queue grows (over {gw}).",
        )
        + g.alert(
            "KVCacheGPUMemoryOverBudget",
            "kvcache_gpu_memory_budget_usage_ratio > <threshold>",
            "GPU memory use exceeds the budget vLLM was given.",
            f"{GPU} uses {VALUE} of the memory budget vLLM was given (gpu_memory_utilization x total): "
            "something else on the GPU is using memory vLLM counts on.",
        )
        + g.alert(
            "KVCacheGPUMemorySwingLarge",
            f"instance_gpu:kvcache_gpu_memory_swing:ratio{mw} > <threshold>",
            "GPU memory use swings enough to endanger co-located processes.",
            f"GPU memory use of {GPU} swung by {VALUE} of the GPU's memory within {mw}.",
        )
    )


def config_checks(g) -> list[dict]:
    named = {
        "prefix_caching_enabled": "PrefixCachingDisabled",
        "gpu_memory_utilization_ceiling": "GPUMemoryUtilizationTooHigh",
    }
    check = (
        "Configuration check {{ $labels.check }} of {{ $labels.model_name }} on {{ $labels.instance }}"
        + WHERE
    )
    return (
        g.alert(
            "KVCachePrefixCachingDisabled",
            'kvcache_config_check{check="prefix_caching_enabled"} == 0',
            "vLLM runs with prefix caching disabled.",
            f"{check} fails (value {{{{ $value }}}}): vLLM was started without "
            "--enable-prefix-caching, so no prompt prefix is ever reused.",
        )
        + g.alert(
            "KVCacheGPUMemoryUtilizationTooHigh",
            'kvcache_config_check{check="gpu_memory_utilization_ceiling"} == 0',
            "vLLM leaves too little memory on a GPU it shares with other processes.",
            f"{check} fails (value {{{{ $value }}}}): the GPU is shared (another process holds memory, "
            "or used memory swings) and gpu_memory_utilization is above the configured ceiling, or the "
            "lowest free memory falls below the measured swing.",
        )
        + g.alert(
            "KVCacheConfigCheckFailed",
            f'kvcache_config_check{{check!~"{"|".join(named)}"}} == 0',
            "A vLLM cache configuration check fails.",
            f"{check} fails (value {{{{ $value }}}}).",
        )
        + g.alert(
            "KVCacheVLLMMetricsMissing",
            "kvcache_vllm_missing_metrics > 0",
            "Expected vLLM metrics are missing: the vLLM metric schema drifted.",
            "{{ $value }} expected vLLM metrics are missing from the scrape by {{ $labels.instance }}"
            + WHERE
            + "; dashboards and alerts built on them go blank.",
        )
        + g.alert(
            "KVCacheVLLMMetricsDeprecated",
            "kvcache_vllm_deprecated_metrics > 0",
            "vLLM exposes deprecated metric names that a future release removes.",
            "{{ $value }} deprecated vLLM metric names are still read by {{ $labels.instance }}"
            + WHERE
            + ".",
        )
    )


def cost(g) -> list[dict]:
    hr = g.cfg["hit_ratio"]
    w, tps = hr["windows"][0], hr["min_query_tokens_per_second"]
    cpm = "instance:kvcache_cost_per_million_tokens:window1h"
    guard = f"and instance:kvcache_prefix_cache_query_tokens:rate{w} > {tps}"
    where = "{{ $labels.instance }}" + WHERE
    return g.alert(
        "KVCacheCostOverBudget",
        f"{cpm} > <threshold>\n{guard}",
        "GPU cost per million tokens is above budget.",
        f'GPU cost per million tokens on {where} is {{{{ $value | printf "%.2f" }}}} over the last '
        "hour, above the budget of <threshold> (currency of kvcache_cost_info).",
    ) + g.alert(
        "KVCacheCostAboveBaseline",
        f"{cpm} > <factor> * ({cpm} offset <offset>)\n{guard}",
        "GPU cost per million tokens is well above the same time yesterday.",
        f'GPU cost per million tokens on {where} is {{{{ $value | printf "%.2f" }}}} over the last '
        "hour, more than <factor>x its value <baseline_offset> earlier.",
        offset=lambda s: g.d(s["baseline_offset"]),
    )


def health(g) -> list[dict]:
    job, missed = g.cfg["exporter_job"], g.cfg["alerts"]["KVCacheEventsMissed"]["window"]
    return (
        g.alert(
            "KVCacheExporterDown",
            f'up{{job=~"{job}"}} == 0',
            "Prometheus cannot scrape the kvcache exporter.",
            "Prometheus cannot scrape {{ $labels.instance }} (job {{ $labels.job }})"
            + WHERE
            + " (up = {{ $value }}): the KV-cache alerts for its vLLM are blind.",
        )
        + g.alert(
            "KVCacheExporterAbsent",
            f'absent(up{{job=~"{job}"}})',
            "No kvcache exporter is scraped at all.",
            f'Prometheus has no target whose job matches "{job}": the KV-cache alerts are blind.',
        )
        + g.alert(
            "KVCacheVLLMDown",
            "kvcache_vllm_up == 0",
            "The exporter cannot poll vLLM's /metrics.",
            "{{ $labels.instance }}"
            + WHERE
            + " cannot poll vLLM's /metrics (kvcache_vllm_up = {{ $value }}): "
            "vLLM is down, restarting or unreachable.",
        )
        + g.alert(
            "KVCacheCollectorFailing",
            "kvcache_exporter_collector_success == 0",
            "An exporter collector keeps failing.",
            "Collector {{ $labels.collector }} of {{ $labels.instance }}"
            + WHERE
            + " has failed (success = {{ $value }}); see kvcache_exporter_errors_total for the reason.",
        )
        + g.alert(
            "KVCacheEventsMissed",
            f"increase(kvcache_kv_events_missed_batches_total[{g.d(missed)}]) > 0",
            "KV-event batches from vLLM were lost.",
            "{{ $labels.instance }}" + WHERE + ' lost {{ $value | printf "%.0f" }} KV-event batches in the '
            f"last {missed}: block counts from the event stream are off until the next AllBlocksCleared.",
        )
    )


# --- the fleet aggregator's own health (issue 23: every process we ship is watched) ----------
def aggregator_health(g) -> list[dict]:
    """Down and absent as for the sidecar. Absent means "scraped within the last day, no target
    now": a plain absent() would fire on every install that runs no aggregator at all."""
    job = g.cfg["aggregator_job"]
    return g.alert(
        "KVCacheAggregatorDown",
        f'up{{job=~"{job}"}} == 0',
        "Prometheus cannot scrape the fleet aggregator.",
        "Prometheus cannot scrape {{ $labels.instance }} (job {{ $labels.job }}, up = {{ $value }}): "
        "the fleet view of its pool (other-replica misses, duplicate blocks) is blind.",
    ) + g.alert(
        "KVCacheAggregatorAbsent",
        f'group(max_over_time(up{{job=~"{job}"}}[1d]))\nunless on() group(up{{job=~"{job}"}})',
        "The fleet aggregator is no longer scraped.",
        f'Prometheus scraped a target whose job matches "{job}" within the last day and has none now: '
        "the fleet alerts are blind.",
    )


# --- the fleet view on NATS JetStream: sidecars publishing, shards consuming (docs/fleet.md) ----
def fleet_nats(g) -> list[dict]:
    where = "{{ $labels.instance }}" + WHERE
    w = g.cfg["fleet"]["nats_window"]
    return (
        g.alert(
            "KVCacheFleetPublishDropping",
            f"sum without(reason) (increase(kvcache_fleet_publish_dropped_total[{w}])) > 0",
            "A sidecar drops residency deltas instead of publishing them to NATS.",
            f'{where} dropped {{{{ $value | printf "%.0f" }}}} messages for NATS over the last {w} '
            "(kvcache_fleet_publish_dropped_total by reason): the aggregator shards count the gap as "
            "missed and their residency of this replica is off until it stores its blocks again.",
        )
        + g.alert(
            "KVCacheFleetPublishLagging",
            "kvcache_fleet_publish_lag_seconds > <threshold>",
            "A sidecar's deltas wait for NATS longer than the fleet view can use them.",
            f"The oldest message in the publish buffer of {where} has waited "
            "{{ $value | humanizeDuration }} (over <threshold>s): NATS is down, unreachable or slower "
            "than the replica's event stream; the buffer drops once full.",
        )
        + g.alert(
            "KVCacheFleetResyncFailed",
            f'increase(kvcache_fleet_publish_resyncs_total{{result="failed"}}[{w}]) > 0',
            "A sidecar could not resend what a NATS outage made it hold from vLLM's replay.",
            f'{where} failed {{{{ $value | printf "%.0f" }}}} resyncs over the last {w} '
            '(kvcache_fleet_publish_resyncs_total{result="failed"}): vLLM\'s replay no longer held '
            "the first held batch, vLLM restarted meanwhile, or the replay did not answer; the shards "
            "count the gap as missed and their residency of this replica is off until it stores its "
            "blocks again.",
        )
        + g.alert(
            "KVCacheFleetConsumerLagging",
            "kvcache_fleet_consumer_pending > <threshold>",
            "An aggregator shard falls behind its part of the NATS stream.",
            "The consumer {{ $labels.consumer }} of {{ $labels.instance }} has "
            '{{ $value | printf "%.0f" }} messages it has not read yet (over <threshold>): its fleet '
            "view lags the pool, and lags more the longer it stays; past the stream's retention, "
            "deltas are lost.",
        )
        + g.alert(
            "KVCacheFleetRedeliveries",
            f"rate(kvcache_fleet_consumer_redelivered_total[{w}]) > <threshold>",
            "NATS delivers deltas to an aggregator shard more than once.",
            "{{ $labels.instance }} receives {{ $value | humanize }} redelivered messages a second "
            f"over {w} (over <threshold>): it acks too late (overloaded, or restarting over and over); "
            "duplicates are dropped, so the numbers hold, but the shard is not keeping up.",
        )
    )


def fleet(g) -> list[dict]:
    w, tps = g.cfg["fleet"]["window"], g.cfg["fleet"]["min_stored_tokens_per_second"]
    share, stored = (
        f"job:kvcache_fleet_other_replica:ratio_rate{w}",
        f"job:kvcache_fleet_stored_tokens:rate{w}",
    )
    ratios = "".join(
        f'{{{{ with printf "job:kvcache_fleet_{rule}:ratio_rate{w}{{job=%q}}" $labels.job | query }}}}'
        f"{{{{ with first . }}}}{text} {{{{ value . | humanizePercentage }}}}{{{{ end }}}}{{{{ end }}}}"
        for rule, text in (
            ("hit_estimate", " With prefix-affinity routing the pool's hit ratio would be about"),
            ("hit", " instead of"),
        )
    )
    return g.alert(
        "KVCacheAffinityLoss",
        f"{share} > <threshold>\nand {stored} > {tps}",
        "Replicas recompute prefixes that another replica of the pool holds.",
        f"{VALUE} of the tokens the replicas of pool {{{{ $labels.job }}}} computed over {w} were "
        f"resident on another replica (other_replica), above <pct>.{ratios}.",
        pct=lambda s: pct(s["threshold"]),
    )


def _figure(series: str, labels: str | None, text: str, inner: str = "", after: str = "") -> str:
    """Template text shown when Prometheus has `series{labels}` for the alert's instance: `text` with
    its value as a percentage for {}, then `inner` (nested figures), then `after`."""
    query = series if labels is None else f"{series}{{{labels},instance=%q}}"
    query = query.replace('"', '\\"')
    value = "{{ value . | humanizePercentage }}"
    return (
        f'{{{{ with printf "{query}" $labels.instance | query }}}}'
        f"{{{{ with first . }}}}{text.format(value)}{inner}{after}{{{{ end }}}}{{{{ end }}}}"
    )


def attribution(g) -> list[dict]:
    a = g.cfg["attribution"]
    w, tps = a["window"], a["min_miss_tokens_per_second"]
    share = f"instance_cause:kvcache_prefix_cache_miss_tokens:ratio_rate{w}"
    guard = f"and ignoring(cause) instance:kvcache_prefix_cache_miss_tokens:rate{w} > {tps}"
    where = "{{ $labels.instance }}" + WHERE
    offset = (
        '{{ with printf "histogram_quantile(0.5, sum by(le) ('
        f'rate(kvcache_prefix_divergence_offset_tokens_bucket{{instance=%q}}[{w}])))" $labels.instance '
        "| query }}{{ with first . }} The shared content "
        'starts about {{ value . | printf "%.0f" }} tokens into the prompt (median).{{ end }}{{ end }}'
    )
    now = f"sum({RATIO}{g.cfg['hit_ratio']['windows'][0]}{{instance=%q}})"
    worth = _figure(
        "kvcache_prefix_cache_hit_ratio_reordered_estimate",
        f'window="{w}"',
        " Moving the per-request fields after the shared part: a hit ratio of about {}",
        _figure(now, None, " instead of {}"),
        ".",
    )
    estimate = _figure(
        "kvcache_prefix_cache_hit_ratio_estimate",
        f'window="{w}",capacity_factor="2"',
        f" Over {w}, with twice the KV cache the hit ratio would be about {{}}",
        _figure(
            "kvcache_prefix_cache_hit_ratio_host_tier_estimate",
            f'window="{w}"',
            "; with the host (CPU) tier of --whatif.host-tier-bytes, about {}",
        )
        + _figure(now, None, " (it is {} now)"),
        ".",
    )
    idle, reuse = (f"{LVL}:vllm_kv_block_{h}_seconds:p50_rate{w}" for h in ("idle_before_evict", "reuse_gap"))
    short, min_tps = g.cfg["hit_ratio"]["windows"][0], g.cfg["hit_ratio"]["min_query_tokens_per_second"]
    return (
        g.alert(
            "KVCacheMissesFromDivergedPrefix",
            f'{share}{{cause="prefix_diverged"}} > <threshold>\n{guard}',
            "Most prefix-cache misses recompute shared content behind a per-request prefix.",
            f"{VALUE} of the prompt tokens {where} computed over {w} were shared content behind a "
            "per-request front part that a reorder would have served (cause prefix_diverged): per-request "
            f"fields come before the shared part.{offset}{worth}",
        )
        + g.alert(
            "KVCacheEvictionThrashing",
            f'(\n  {share}{{cause="evicted"}} > <threshold>\n  {guard}\n)\n'
            f"or on(instance) (\n  {idle} < {reuse}\n  and on(instance) sum without(model_name, target) "
            f"({QUERY}{short}) > {min_tps}\n)",
            "The KV cache evicts blocks before they are reused.",
            f"On {where} blocks are evicted before they are reused: {VALUE} (the evicted share of computed "
            f"prompt tokens over {w}, or the median idle time before eviction in seconds when that is "
            f"shorter than the median reuse gap).{estimate}",
        )
        + [
            rule
            for cause, texts in FAULT_ALERTS.items()
            for rule in _fault(g, cause, *texts, share, guard, where)
        ]
        + g.alert(
            "KVCacheMissAttributionIncomplete",
            f'kvcache_prefix_cache_miss_attribution_coverage_ratio{{window="{w}"}} < <threshold>\n'
            f"or on(instance) 0 * (\n  {QUERY}{short} > 0\n"
            "  unless on(instance) kvcache_prefix_cache_miss_tokens_total\n)",
            "Miss attribution covers too few of vLLM's computed tokens to be trusted.",
            f"The KV-event stream of {where} attributed {VALUE} of the prompt tokens vLLM computed over "
            f"{w} (below <pct>), or KV events are off: kvcache_prefix_cache_miss_tokens_total is only a "
            "partial breakdown.",
            pct=lambda s: pct(s["threshold"]),
        )
    )


# The fault causes of docs/kv-events.md beside prefix_diverged and evicted: cause -> (alert, summary,
# what the stream shows, the action and what it is worth).
FAULT_ALERTS = {
    "history_rewritten": (
        "KVCacheMissesFromRewrittenHistory",
        "Many prefix-cache misses recompute a conversation the chat template re-renders differently.",
        "text the model generated, re-rendered unlike it was generated (cause history_rewritten): the chat "
        "template drops or rewrites earlier assistant turns (reasoning removed, tool-call arguments "
        "re-serialised), so every turn leaves the cache where the previous answer starts",
        "Make the template reproduce the generated text verbatim (keep the reasoning, render tool "
        "arguments canonically): those tokens would have hit.",
    ),
    "content_moved": (
        "KVCacheMissesFromMovedContent",
        "Many prefix-cache misses recompute shared sections listed in another order.",
        "shared sections in another order than before (cause content_moved): tools, documents or "
        "retrieved passages are listed or ranked differently per request",
        "Sort the sections deterministically (or put the per-request ranking after them): those tokens "
        "would have hit.",
    ),
    "window_expired": (
        "KVCacheMissesFromExpiredWindows",
        "Prefixes are recomputed because their sliding-window part was dropped before reuse.",
        "units whose sliding-window or state part vLLM dropped while the full-attention part was still "
        "held (cause window_expired): on a hybrid model the prefix is not hittable without it",
        "Set vLLM's --prefix-cache-retention-interval (0 by default) to about the reuse gap, so the "
        "window part is kept: those tokens would have hit.",
    ),
    "below_hit_unit": (
        "KVCacheSharedContentBelowHitUnit",
        "Shared prompt content is shorter than the unit vLLM hits in, so it never hits.",
        "shared content at the point where prompts leave the cache, shorter than a whole hit unit "
        "(cause below_hit_unit; kvcache_kv_events_hit_unit_tokens is the unit)",
        "Make the shared part at least one hit unit long, or align it to the unit (pad the template): "
        "those tokens would hit.",
    ),
}


def _fault(g, cause: str, name: str, summary: str, shows: str, fix: str, share, guard, where) -> list[dict]:
    return g.alert(
        name,
        f'{share}{{cause="{cause}"}} > <threshold>\n{guard}',
        summary,
        f"{VALUE} of the prompt tokens {where} computed over {g.cfg['attribution']['window']} were {shows}. "
        + fix,
    )


ALERT_GROUPS = (
    ("kvcache-hit-ratio.alerts", hit_ratio),
    ("kvcache-latency-slo.alerts", latency_slo),
    ("kvcache-capacity.alerts", capacity),
    ("kvcache-config.alerts", config_checks),
    ("kvcache-cost.alerts", cost),
    ("kvcache-health.alerts", health),
    ("kvcache-aggregator.alerts", aggregator_health),
    ("kvcache-fleet.alerts", fleet),
    ("kvcache-fleet-nats.alerts", fleet_nats),
    ("kvcache-attribution.alerts", attribution),
)
