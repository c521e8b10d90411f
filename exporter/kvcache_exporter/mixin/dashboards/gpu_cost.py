"""kvcache-gpu-cost: GPU memory, utilization and power, and what the tokens cost."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import units

from .common import TOKENS_PER_SECOND, Query, dashboard, graph, grid, rate, sel

UID = "kvcache-gpu-cost"
GPU = "gpu{{gpu}} {{name}}"
MEMORY_ALERTS = ("KVCacheGPUMemoryOverBudget", "KVCacheGPUMemorySwingLarge")
COST_ALERTS = (
    "KVCacheCostOverBudget",
    "KVCacheCostAboveBaseline",
)


def _gpu():
    return [
        graph(
            "GPU memory: used, budget, total",
            Query(sel("kvcache_gpu_memory_used_bytes"), f"used {GPU}"),
            Query(sel("kvcache_gpu_memory_budget_bytes"), f"budget {GPU}"),
            Query(sel("kvcache_gpu_memory_total_bytes"), f"total {GPU}"),
            shows="GPU memory in use, the budget vLLM was given (gpu_memory_utilization x total), and total.",
            action="Used above budget: another process shares the GPU (see the per-process panel).",
            alerts=MEMORY_ALERTS[:1],
            unit=units.BytesIEC,
        ),
        graph(
            "GPU memory swing",
            Query(sel("kvcache_gpu_memory_swing_bytes"), f"{GPU} {{{{window}}}}"),
            shows="Largest minus smallest GPU memory in use over each window. vLLM preallocates its KV "
            "cache, so its memory should be flat.",
            action="A swing means something allocates and frees on the GPU: find it per process.",
            alerts=MEMORY_ALERTS[1:],
            unit=units.BytesIEC,
        ),
        graph(
            "GPU memory per process",
            Query(sel("kvcache_gpu_process_memory_used_bytes"), "gpu{{gpu}} {{process}} ({{pid}})"),
            shows="GPU memory per process (vLLM's processes or the top few); empty with the DCGM source.",
            action="Another process with a large share: move it off this GPU or shrink vLLM's budget.",
            alerts=MEMORY_ALERTS,
            unit=units.BytesIEC,
            w=8,
        ),
        graph(
            "GPU utilization",
            Query(sel("kvcache_gpu_utilization_ratio"), f"SM {GPU}"),
            Query(sel("kvcache_gpu_memory_bandwidth_utilization_ratio"), f"memory {GPU}"),
            shows="SM utilization and memory-controller utilization, 0-100 %.",
            action="Low with a long queue: the batch is limited by KV blocks, not compute.",
            alerts=("KVCacheSaturated",),
            unit=units.PercentUnit,
            w=8,
        ),
        graph(
            "Power",
            Query(sel("kvcache_gpu_power_watts"), f"draw {GPU}"),
            Query(f"rate({sel('kvcache_gpu_energy_joules_total')}[$__rate_interval])", f"from energy {GPU}"),
            shows="Power draw as reported, and as the rate of the energy counter (both in watts).",
            action="Power at the cap while throughput drops: the GPU is throttling (check temperature).",
            alerts=COST_ALERTS,
            unit=units.Watt,
            w=8,
        ),
    ]


def _cost():
    return [
        graph(
            "Cost per million tokens ($currency)",
            Query(sel("kvcache_cost_per_million_tokens"), "{{token_kind}} {{window}}"),
            shows="GPU cost over each window per million tokens, prompt vs generation (currency: see the "
            "Pricing panel).",
            action="Rising at a flat price: throughput fell, or cache misses add prefill work.",
            alerts=COST_ALERTS,
        ),
        graph(
            "Cost and savings per hour ($currency)",
            Query(sel("kvcache_gpu_cost_per_hour"), "GPU cost"),
            Query(sel("kvcache_cache_savings_per_hour"), "saved by the prefix cache {{window}}"),
            Query(
                sel("kvcache_cache_miss_extra_cost_per_hour"), "extra if hit ratio fell to floor {{window}}"
            ),
            shows="What the watched GPUs cost per hour, what the prefix cache saves, and what a hit ratio "
            "at the floor would add.",
            action="Savings falling: the hit ratio dropped (see the overview).",
            alerts=(*COST_ALERTS, "KVCacheHitRatioBelowFloor"),
        ),
        graph(
            "Energy per token",
            Query(sel("kvcache_energy_joules_per_token"), "{{window}}"),
            shows="GPU energy per token (prompt + generation) over each window.",
            action="Rising energy per token: lower batch efficiency or more recomputed prefill.",
            alerts=COST_ALERTS,
            unit=units.Joule,
            w=8,
        ),
        graph(
            "Throughput",
            Query(rate("kvcache_prompt_tokens_total", "source"), "prompt {{source}}"),
            Query(rate("kvcache_generation_tokens_total", ""), "generated"),
            shows="Tokens per second that the cost is spread over.",
            action="Falling throughput at constant GPU cost raises cost per token.",
            alerts=COST_ALERTS,
            unit=TOKENS_PER_SECOND,
            w=8,
        ),
        grid(
            "Pricing",
            Query(sel("kvcache_cost_info")),
            shows="The currency every cost panel uses, as configured in the exporter.",
            action="Wrong currency or missing: fix the exporter's cost configuration.",
            alerts=COST_ALERTS,
            w=8,
        ),
    ]


def build() -> db.Dashboard:
    rows = {"GPU": _gpu(), "Cost and energy": _cost()}
    return dashboard(UID, "KV cache / GPU and cost", "GPU memory, utilization, power, token economics.", rows)
