"""The report of a block-hash trace (observed, unbounded, curve, misses by cause) and the curve's text."""

from __future__ import annotations

from dataclasses import asdict

from . import hosttier
from .blocktrace import Parsed
from .diagnoses import SIGNIFICANT, diagnose
from .mrc import Curve
from .replay import Replay


def needed_for(curve: dict, target: float) -> int | None:
    """The smallest measured pool size reaching `target` hit ratio."""
    for point in curve["points"]:
        if point["fits"] and point["hit_ratio"] >= target:
            return point["num_gpu_blocks"]
    return None


def block_report(parsed: Parsed, curve: Curve, settings: dict) -> dict:
    def replay_dict(hit_tokens: int) -> dict:
        return {
            "hit_ratio": round(curve.ratio(hit_tokens), 6),
            "prompt_tokens": curve.prompt_tokens,
            "hit_tokens": hit_tokens,
            "requests": len(parsed.requests),
        }

    return {
        "settings": {**settings, "requests": len(parsed.requests), "format": parsed.kind},
        "observed": replay_dict(curve.observed_hit_tokens),
        "unbounded": replay_dict(curve.unbounded_hit_tokens),
        "curve": curve.to_dict(),
        "skipped_lines": len(parsed.skipped),
    }


def replay_dict(replay: Replay) -> dict:
    """An engine replay's line of a hash trace's report (the overlapping observed one)."""
    return {
        "hit_ratio": round(replay.hit_ratio, 6),
        "prompt_tokens": replay.prompt_tokens,
        "hit_tokens": replay.hit_tokens,
        "requests": replay.requests,
        "rejected": replay.rejected,
        "preemptions": replay.preemptions,
    }


def render_curve(curve: dict, num_gpu_blocks: int, block_size: int) -> list[str]:
    title = f"blocks of {block_size} tokens per replica; * = this pool"
    lines = ["", f"miss-ratio curve: the hit ratio by cache size ({title})"]
    for point in curve["points"]:
        mark = "*" if point["num_gpu_blocks"] == num_gpu_blocks else " "
        fits = "" if point["fits"] else "  (the longest request does not fit)"
        bar = "#" * round(point["hit_ratio"] * 40)
        lines.append(f" {mark}{point['num_gpu_blocks']:9d}  {point['hit_ratio']:6.3f}  {bar}{fits}")
    for target in (0.5, 0.6, 0.8):
        if target <= curve["unbounded_hit_ratio"]:
            size = needed_for(curve, target)
            largest = curve["points"][-1]["num_gpu_blocks"]
            answer = f"about {size} blocks" if size else f"more than the {largest} blocks measured"
            lines.append(f"  hit ratio {target:.0%} needs {answer}")
    misses = curve["misses_by_cause"]
    total = sum(misses.values()) or 1
    lines += ["", "computed prompt tokens by cause (at this pool)"]
    lines += [f"  {cause:18s} {tokens:12d}  {tokens / total:6.1%}" for cause, tokens in misses.items()]
    if curve["restarts"]:
        lines.append(f"  restarts replayed: {curve['restarts']}")
    return lines


def block_diagnoses(report: dict) -> list[dict]:
    """A hash trace's diagnoses (diagnoses.CAUSES): no content, so capacity is the one that can hold; the
    blocks needed come from the curve."""
    s, observed, unbounded = report["settings"], report["observed"], report["unbounded"]
    needed = text = None
    if unbounded["hit_ratio"] - observed["hit_ratio"] >= SIGNIFICANT:
        needed = needed_for(report["curve"], unbounded["hit_ratio"] - 0.01)
        largest = report["curve"]["points"][-1]["num_gpu_blocks"]
        text = (
            f"about {needed} blocks per replica ({needed * s['block_size']} tokens)"
            if needed
            else (f"more than the {largest} blocks per replica measured")
        )
        needed = needed or largest
    facts = {
        **dict.fromkeys(("one_replica", "reordered", "dyn_requests", "dyn_start", "dyn_where", "dyn_end")),
        **dict.fromkeys(("dyn_len", "dyn_template")),
        "block_size": s["block_size"],
        "num_gpu_blocks": s["num_gpu_blocks"],
        "replicas": s["replicas"],
        "routing": s["routing"],
        "observed": observed["hit_ratio"],
        "unbounded": unbounded["hit_ratio"],
        "session_text": "",
        "needed_blocks": needed,
        "needed_text": text,
        "preemptions": observed.get("preemptions", 0),
        "first_block_unique": 0.0,
        "granularity_loss": 0.0,
        "host_text": hosttier.evidence(report.get("host_tier")),
    }
    return [asdict(d) for d in diagnose(facts)]


def render_diagnoses(diagnoses: list[dict], observed: float) -> list[str]:
    lines = ["", "diagnosis"]
    if not diagnoses:
        lines.append("  no significant cache loss found")
    for n, d in enumerate(diagnoses, 1):
        worth = f"fixing it is worth {d['gain']:+.3f} (hit ratio {d['after']:.3f} instead of {observed:.3f})"
        lines.append(f"  {n}. [{d['kind']}] {d['title']}: {worth}")
        lines.append(f"     {d['evidence']}")
        lines += [f"     - {r}" for r in d["remedies"]]
    return lines


ASSUMED = "assumed "


def assumed_notes(notes: list[str]) -> list[str]:
    """What the analysis assumed (capture.cache_shape), said under the first line."""
    return [f"note: {n}" for n in notes if n.startswith(ASSUMED)]


def render_units(units: list[dict] | None) -> list[str]:
    """The hit unit's cost: hit ratio with no eviction at each unit, and the shared tokens it loses."""
    if not units:
        return []
    lines = ["", "hit unit (tokens per block; vLLM hits whole units only), with no eviction"]
    for row in units:
        lost = f"  {row['lost_tokens']:,} shared tokens short of a whole unit" if row["lost_tokens"] else ""
        lines.append(f"  {row['unit']:5d}  {row['unbounded_hit_ratio']:6.3f}{lost}")
    return lines


def render_block_text(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"trace: {s['requests']} requests ({s['format']}, {s['trace_block_size']}-token trace blocks); "
        f"block size {s['block_size']}, {s['num_gpu_blocks']} blocks per replica, {s['replicas']} "
        f"replica(s), {s['routing']} routing ({s['replay']})",
        *assumed_notes(report.get("notes", [])),
        "",
        "hit ratio (prompt tokens served from the prefix cache)",
        f"  observed (this cache)           {report['observed']['hit_ratio']:6.3f}",
        f"  unbounded cache                 {report['unbounded']['hit_ratio']:6.3f}",
    ]
    lines += hosttier.render_text(report.get("host_tier"))
    if "preemptions" in report["observed"]:
        lines += [
            f"  preemptions (observed)          {report['observed']['preemptions']:6d}",
            "  (unbounded, the curve and the causes: sequential per replica)",
        ]
    lines += render_diagnoses(report.get("diagnoses", []), report["observed"]["hit_ratio"])
    lines += render_curve(report["curve"], s["num_gpu_blocks"], s["block_size"])
    lines += render_units(report.get("units"))
    lines += ["", *[f"note: {n}" for n in report.get("notes", []) if not n.startswith(ASSUMED)]]
    return "\n".join(lines) + "\n"
