"""Recording and alerting rules from the mixin's config (`kvcache-exporter mixin`, `make generate`).

    python -m alerts.generate [--config alerts/config.yaml] [--out alerts/rules] [--scale 1]

`--scale` multiplies every duration (windows, offsets, `for:`, evaluation interval) so the
end-to-end test can run the same rules in seconds; rule names keep the configured windows.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ..durations import format_duration, parse_duration
from .alert_rules import ALERT_GROUPS, HIT, LVL, QUERY, RATIO


def le_regex(value: float) -> str:
    """vLLM (Python client) prints le="1.0", Go clients le="1": match both, and trailing zeros."""
    whole, _, frac = repr(float(value)).partition(".")
    frac = frac.rstrip("0")
    return rf"{whole}\\.{frac}0*" if frac else rf"{whole}(\\.0*)?"


def metric_slug(histogram: str) -> str:
    return histogram.replace(":", "_")


class Generator:
    def __init__(self, cfg: dict, scale: float = 1.0):
        self.cfg, self.scale = cfg, scale

    def d(self, text: str) -> str:
        return format_duration(parse_duration(text) * self.scale)

    def tiers(self, name: str) -> list[tuple[str, dict]]:
        entry = self.cfg["alerts"][name]
        if "severity" in entry:
            return [(entry["severity"], entry)]
        return [(sev, entry[sev]) for sev in ("critical", "warning", "info") if sev in entry]

    def alert(self, name: str, expr: str, summary: str, description: str, **derived) -> list[dict]:
        """One rule per severity tier; `<key>` in expr/description is the tier's config value, or
        derived[key](spec) for values computed from it."""
        rules = []
        for severity, spec in self.tiers(name):
            spec = {**spec, "severity": severity, "for": self.d(spec["for"])}
            spec.update({key: fn(spec) for key, fn in derived.items()})

            def fill(text: str, spec: dict = spec) -> str:
                return re.sub(r"<(\w+)>", lambda m: str(spec[m.group(1)]), text)

            annotations = {
                "summary": summary,
                "description": fill(description),
                "runbook_url": f"{self.cfg['urls']['runbook']}#{name.lower()}",
            }
            if "dashboard" in spec:
                annotations["dashboard_url"] = f"{self.cfg['urls']['grafana']}/d/{spec['dashboard']}"
            rules.append(
                {
                    "alert": name,
                    "expr": fill(expr).strip(),
                    "for": spec["for"],
                    "labels": {"severity": severity},
                    "annotations": annotations,
                }
            )
        return rules

    def group(self, name: str, rules: list[dict]) -> dict:
        return {"name": name, "interval": self.d(self.cfg["evaluation_interval"]), "rules": rules}

    # --- recording rules ----------------------------------------------------------------------
    def recording(self) -> dict:
        hr, slo = self.cfg["hit_ratio"], self.cfg["slo"]
        hit = []
        for w in hr["windows"]:
            for name, counter in ((HIT, "hit"), (QUERY, "query")):
                expr = f"sum without(engine) (rate(kvcache_prefix_cache_{counter}_tokens_total[{self.d(w)}]))"
                hit.append({"record": f"{name}{w}", "expr": expr})
            hit.append({"record": f"{RATIO}{w}", "expr": f"{HIT}{w} / ({QUERY}{w} > 0)"})
        short = hr["windows"][0]
        hit.append(
            {
                "record": f"instance:kvcache_prefix_cache_query_tokens:rate{short}",
                "expr": f"sum without(model_name, target) ({QUERY}{short})",
            }
        )
        windows = sorted(
            {w for pairs in slo["burn_rates"].values() for p in pairs for w in (p["long"], p["short"])},
            key=parse_duration,
        )
        latency = []
        for name, lat in slo["latencies"].items():
            if float(lat["threshold_seconds"]) not in map(float, lat["buckets"]):
                where = f"slo.latencies.{name}.threshold_seconds"
                raise ValueError(
                    f"{where}: {lat['threshold_seconds']} is not one of {lat['histogram']}'s buckets"
                )
            h, slug = lat["histogram"], metric_slug(lat["histogram"])
            le = le_regex(lat["threshold_seconds"])
            for w in windows:
                count = f"{LVL}:{slug}_count:rate{w}"
                good = f'sum without(engine, le) (rate({h}_bucket{{le=~"{le}"}}[{self.d(w)}]))'
                latency += [
                    {"record": count, "expr": f"sum without(engine) (rate({h}_count[{self.d(w)}]))"},
                    {
                        "record": f"{LVL}:{slug}:slo_error_ratio_rate{w}",
                        "expr": f"1 - {good} / ({count} > 0)",
                    },
                ]
        sat, mem = self.cfg["saturation"], self.cfg["memory"]
        sw, gw, mw = sat["window"], sat["growth_window"], mem["swing_window"]
        used = f"kvcache_gpu_memory_used_bytes[{self.d(mw)}]"
        capacity = [
            {
                "record": f"{LVL}:kvcache_block_utilization:max_avg{sw}",
                "expr": f"max without(engine) (avg_over_time(kvcache_block_utilization_ratio[{self.d(sw)}]))",
            },
            {
                "record": f"{LVL}:kvcache_preemptions:rate{gw}",
                "expr": f"sum without(engine) (rate(kvcache_preemptions_total[{self.d(gw)}]))",
            },
            {
                "record": f"{LVL}:kvcache_requests_waiting:deriv{gw}",
                "expr": f"sum without(engine) (deriv(kvcache_requests_waiting[{self.d(gw)}]))",
            },
            {
                "record": f"instance_gpu:kvcache_gpu_memory_swing:ratio{mw}",
                "expr": f'(\n  max without(window) (kvcache_gpu_memory_swing_bytes{{window="{mw}"}})\n'
                f"  or (max_over_time({used}) - min_over_time({used}))\n)\n/ kvcache_gpu_memory_total_bytes",
            },
            {
                "record": "instance:kvcache_cost_per_million_tokens:window1h",
                "expr": 'max without(token_kind, window) (kvcache_cost_per_million_tokens{token_kind="all", '
                'window="1h"})',
            },
        ]
        return {
            "groups": [
                self.group("kvcache-hit-ratio.rules", hit),
                self.group("kvcache-latency-slo.rules", latency),
                self.group("kvcache-capacity.rules", capacity),
                self.group("kvcache-fleet.rules", self.fleet_recording()),
                self.group("kvcache-attribution.rules", self.attribution_recording()),
            ]
        }

    def fleet_recording(self) -> list[dict]:
        """Pool ratios from the aggregator's counters, summed over its shards (`by (job)`: one
        aggregator job per pool). vLLM's counters are polled by every shard alike: max over shards."""
        w = self.cfg["fleet"]["window"]
        r = f"[{self.d(w)}]"
        other = f'rate(kvcache_prefix_cache_miss_tokens_total{{cause="other_replica"}}{r})'
        rules = [
            (
                "job:kvcache_fleet_stored_tokens:rate",
                f"sum by (job) (rate(kvcache_fleet_stored_tokens_total{r}))",
            ),
            ("job:kvcache_fleet_other_replica_tokens:rate", f"sum by (job) ({other})"),
            (
                "job:kvcache_fleet_query_tokens:rate",
                f"sum by (job) (max by (job, replica) (rate(kvcache_fleet_query_tokens_total{r})))",
            ),
            (
                "job:kvcache_fleet_hit_tokens:rate",
                f"sum by (job) (max by (job, replica) (rate(kvcache_fleet_hit_tokens_total{r})))",
            ),
        ]
        out = [{"record": f"{name}{w}", "expr": expr} for name, expr in rules]
        hits, other = (
            f"job:kvcache_fleet_hit_tokens:rate{w}",
            f"job:kvcache_fleet_other_replica_tokens:rate{w}",
        )
        queries, stored = (
            f"(job:kvcache_fleet_query_tokens:rate{w} > 0)",
            f"job:kvcache_fleet_stored_tokens:rate{w}",
        )
        duplicates = "sum by (job) (kvcache_fleet_duplicate_blocks)"
        out += [
            {"record": f"job:kvcache_fleet_other_replica:ratio_rate{w}", "expr": f"{other} / ({stored} > 0)"},
            {"record": f"job:kvcache_fleet_hit:ratio_rate{w}", "expr": f"{hits} / {queries}"},
            {
                "record": f"job:kvcache_fleet_hit_estimate:ratio_rate{w}",
                "expr": f"clamp_max(\n  ({hits} + {other})\n  / {queries},\n  1\n)",
            },
            {
                "record": "job:kvcache_fleet_duplicate_blocks:ratio",
                "expr": f"{duplicates}\n/ (sum by (job) (kvcache_fleet_distinct_blocks) > 0)",
            },
        ]
        return out + self.pool_recording()

    def pool_recording(self) -> list[dict]:
        """The pool's hit ratio from the sidecars' own series, for fleets without an aggregator
        polling `/metrics` ("no second Prometheus"): summed over engines and replicas the way
        aggregate sums them, pool = (job, model_name). Sidecars are never sharded: each counter once."""
        w = self.cfg["fleet"]["window"]
        pool = "job_model_name"
        r = f"[{self.d(w)}]"
        out = [
            {
                "record": f"{pool}:kvcache_pool_{counter}_tokens:rate{w}",
                "expr": f"sum by (job, model_name) (rate(kvcache_prefix_cache_{counter}_tokens_total{r}))",
            }
            for counter in ("hit", "query")
        ]
        hits, queries = (f"{pool}:kvcache_pool_{c}_tokens:rate{w}" for c in ("hit", "query"))
        out.append({"record": f"{pool}:kvcache_pool_hit:ratio_rate{w}", "expr": f"{hits} / ({queries} > 0)"})
        return out

    def attribution_recording(self) -> list[dict]:
        """Shares of the sidecar's miss tokens by cause (the aggregator's own series carry `replica`)."""
        w = self.cfg["attribution"]["window"]
        r = f"[{self.d(w)}]"
        by_cause = f"instance_cause:kvcache_prefix_cache_miss_tokens:rate{w}"
        total = f"instance:kvcache_prefix_cache_miss_tokens:rate{w}"
        idle, reuse = (
            f"histogram_quantile(0.5, sum without(engine) (rate(vllm:kv_block_{h}_seconds_bucket{r})))"
            for h in ("idle_before_evict", "reuse_gap")
        )
        return [
            {
                "record": by_cause,
                "expr": "sum without(replica) "
                f'(rate(kvcache_prefix_cache_miss_tokens_total{{replica=""}}{r}))',
            },
            {"record": total, "expr": f"sum without(cause) ({by_cause})"},
            {
                "record": f"instance_cause:kvcache_prefix_cache_miss_tokens:ratio_rate{w}",
                "expr": f"{by_cause}\n/ ignoring(cause) group_left() ({total} > 0)",
            },
            {"record": f"{LVL}:vllm_kv_block_idle_before_evict_seconds:p50_rate{w}", "expr": idle},
            {"record": f"{LVL}:vllm_kv_block_reuse_gap_seconds:p50_rate{w}", "expr": reuse},
        ]

    # --- alerting rules ------------------------------------------------------------------------
    def alerts(self) -> dict:
        return {"groups": [self.group(name, build(self)) for name, build in ALERT_GROUPS]}


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    str,
    lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)

HEADER = "# Generated by kvcache-exporter's mixin from {source}: edit that, then {how}.\n"
REPO_SOURCE = ("alerts/config.yaml", "`make generate`")


def render(cfg: dict, scale: float = 1.0) -> dict[str, dict]:
    """{file name: rules document}; raises ValueError on a config the rules cannot be made from."""
    gen = Generator(cfg, scale)
    return {"recording.yaml": gen.recording(), "alerts.yaml": gen.alerts()}


def write(out: Path, cfg: dict, scale: float = 1.0, source: tuple[str, str] = REPO_SOURCE) -> list[Path]:
    docs = render(cfg, scale)
    out.mkdir(parents=True, exist_ok=True)
    header = HEADER.format(source=source[0], how=source[1])
    paths = []
    for name, doc in docs.items():
        path = out / name
        path.write_text(header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120))
        paths.append(path)
    return paths
