"""`kvcache-exporter analyze TRACE`: why does this prompt workload miss the prefix cache?

Replays the trace (JSON lines: `prompt_token_ids` or `prompt` text or `messages`, optional `session`,
`max_tokens`, `send_ts`, `server_instance`; or OpenAI Batch API lines) through the simulator's model of
vLLM's block pool and scheduler, compares the hit ratio with an unbounded cache and with one replica,
inspects the prompts' prefix structure and prints a ranked diagnosis with remedies, the miss-ratio curve
and misses by cause. Block-hash
traces (Mooncake: `hash_ids`, `input_length`, `output_length`, `timestamp` in ms; Qwen: also `chat_id`,
`parent_chat_id`) are detected and replayed as block ids (see docs/analyzer.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from pathlib import Path

from . import (
    analysis,
    blocktrace,
    capture,
    curvereport,
    hitunit,
    hosttier,
    html,
    lines,
    mrc,
    progress,
    replay,
    tokenize,
    trace,
)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "analyze",
        help="replay a prompt trace through the KV-cache model and diagnose cache misses",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("trace", help="trace file (JSON lines); - reads stdin")
    add("--block-size", type=int, help="tokens per KV block, the hit unit (default: from --metrics, else 16)")
    add("--num-gpu-blocks", type=int, help="KV blocks per replica (default: from --metrics, else 2048)")
    add(
        "--metrics",
        metavar="FILE",
        help="a capture of vLLM's /metrics: block size, hit unit and num_gpu_blocks from cache_config_info",
    )
    add(
        "--max-line-bytes",
        type=int,
        default=lines.MAX_LINE_BYTES,
        help=f"longer trace lines are skipped (default {lines.MAX_LINE_BYTES:,})",
    )
    add("--replicas", type=int, default=1, help="vLLM replicas (data-parallel engines) behind the router")
    add(
        "--routing", choices=("round-robin", "session"), default="round-robin", help="how requests are spread"
    )
    add("--max-model-len", type=int, help="default: the longest request of the trace")
    add("--max-tokens", type=int, default=trace.DEFAULT_MAX_TOKENS, help="for lines without max_tokens")
    add("--requests", metavar="FIRST-LAST", help="only these request positions (0-based, inclusive)")
    add("--phase", help="only lines whose `phase` field has this value")
    add("--format", choices=("text", "json"), default="text", help="report as text or as JSON")
    add(
        "--trace-block-size",
        type=int,
        help="tokens per hash id of a block-hash trace (default 512 Mooncake, 16 Qwen)",
    )
    add("--tokenizer", metavar="PATH", help="the model's tokenizer.json (or its folder) for text prompts")
    add("--html", metavar="FILE", help="also write a self-contained HTML page with the plots")
    add("--concurrency", type=int, metavar="N", help="replay with N clients in a closed loop")
    add(
        "--arrivals",
        action="store_true",
        help="replay in an open loop at the trace's send_ts (hash traces: timestamp)",
    )
    add("--speed", type=float, default=1.0, help="with --arrivals: divide the trace's gaps by this")
    add(
        "--host-tier-bytes",
        type=int,
        metavar="SIZE",
        help="what a host (CPU) KV tier of SIZE bytes is worth: an exact two-tier replay (needs --metrics "
        "for the bytes of a block)",
    )
    add("--host-tier-blocks", type=int, metavar="N", help="the same with a host tier of N blocks per replica")
    add(
        "--restart-at",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="empty every cache before request N (0-based; repeatable), as a restart does",
    )


def _selection(args: argparse.Namespace) -> blocktrace.Selection:
    if not args.requests:
        return blocktrace.Selection(args.phase)
    first, _, last = args.requests.partition("-")
    try:
        return blocktrace.Selection(args.phase, int(first), int(last or first))
    except ValueError:
        raise ValueError(f"--requests {args.requests!r}: FIRST-LAST, 0-based positions") from None


def run(args: argparse.Namespace) -> int:
    try:
        shape = capture.cache_shape(args.block_size, args.num_gpu_blocks, args.metrics)
        args.block_size, args.num_gpu_blocks = shape.block_size, shape.num_gpu_blocks
        if args.block_size < 1 or args.num_gpu_blocks < 2 or args.replicas < 1 or args.max_line_bytes < 1:
            raise ValueError(
                "--block-size >= 1, --num-gpu-blocks >= 2, --replicas >= 1 and --max-line-bytes >= 1 are "
                "required"
            )
        if args.num_gpu_blocks * args.replicas > MAX_POOL_BLOCKS:
            raise ValueError(
                f"{args.num_gpu_blocks:,} blocks x {args.replicas} replica(s) (--num-gpu-blocks, --metrics, "
                f"--replicas): over {MAX_POOL_BLOCKS:,}, more than any real pool"
            )
        if not (math.isfinite(args.speed) and args.speed > 0):
            raise ValueError(f"--speed {args.speed}: a finite number above 0 is needed")
        args.host_tier = capture.host_tier(
            args.host_tier_blocks, args.host_tier_bytes, args.metrics, args.block_size
        )
        if args.host_tier is not None and args.host_tier[0] * args.replicas > MAX_POOL_BLOCKS:
            raise ValueError(f"a host tier of {args.host_tier[0]:,} blocks: over {MAX_POOL_BLOCKS:,}")
        name = "<stdin>" if args.trace == "-" else args.trace
        encoder = _encoder(args)
        with _open(args.trace) as stream:
            bar = progress.Progress(_count_lines(args.trace))
            parsed = blocktrace.parse_lines(
                _warn_on_text(lines.read_lines(stream, args.max_line_bytes), encoder),
                name,
                args.block_size,
                args.trace_block_size,
                args.max_tokens,
                encoder,
                bar,
                _selection(args),
            )
        bar.close()
        bar.total = len(parsed.requests)
        args.progress = bar
        _report_skipped(parsed.skipped)
        if not parsed.requests:
            raise ValueError(f"{name}: no usable request")
        report, curve, hits = _report(parsed, args, encoder)
        notes = report.notes if not isinstance(report, dict) else report.setdefault("notes", [])
        notes[:0] = shape.notes
        if args.html:
            _write_html(args.html, parsed, curve, report, args.restart_at, hits)
    except (OSError, ValueError) as err:
        print(f"analyze: {err}", file=sys.stderr)
        return 2
    if args.format == "json":
        json.dump(report if isinstance(report, dict) else report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif isinstance(report, dict):
        sys.stdout.write(curvereport.render_block_text(report))
    else:
        sys.stdout.write(analysis.render_text(report))
    return 0


def _open(path: str):
    return contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb")


def _count_lines(path: str) -> int:
    """For the progress bar: newlines counted in bounded chunks (0 for stdin: no bar)."""
    if path == "-":
        return 0
    with open(path, "rb") as stream:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: stream.read(1 << 20), b""))


# Blocks replayed at most (all replicas together): the replay keeps ~32 bytes a block (1e8 took 3 GiB, 1e12
# a MemoryError); an H200 serving a 0.5B model holds ~600k blocks of 16 tokens, 28x below this.
MAX_POOL_BLOCKS = 1 << 24

TEXT_PROMPT = re.compile(r'"prompt"\s*:\s*"|"messages"\s*:')


def _encoder(args: argparse.Namespace):
    """A line parser with the model's tokenizer, or None: the default one."""
    if args.tokenizer:
        model = tokenize.ModelTokenizer(args.tokenizer)
        parse = lambda obj, index, max_tokens: trace.parse_trace_line(obj, index, max_tokens, model)  # noqa: E731
        parse.decode = model.decode
        return parse
    return None


def _warn_on_text(numbered, encoder):
    """The lines as they are; a warning on stderr if text shows up in the first 1,000 without --tokenizer."""
    warned = encoder is not None
    for n, (number, line) in enumerate(numbered):
        if not warned and n < 1000 and isinstance(line, str) and TEXT_PROMPT.search(line):
            print(tokenize.APPROXIMATE_WARNING, file=sys.stderr)
            warned = True
        yield number, line


def _report(parsed: blocktrace.Parsed, args: argparse.Namespace, encoder=None):
    bs = args.block_size
    curve = mrc.stack_curve(
        parsed.requests,
        bs,
        args.num_gpu_blocks,
        None,
        args.replicas,
        args.routing,
        args.restart_at,
        getattr(args, "progress", None),
    )
    if getattr(args, "progress", None) is not None:
        args.progress.close()
    if parsed.kind == "tokens":
        restarts = frozenset(mrc.restart_points(parsed.requests, args.restart_at))
        report = analysis.analyze(
            parsed.traces,
            bs,
            args.num_gpu_blocks,
            args.replicas,
            args.routing,
            args.max_model_len,
            restarts,
            args.concurrency,
            args.speed if args.arrivals else None,
            getattr(encoder, "decode", None),
            getattr(args, "host_tier", None),
        )
        curve.misses_by_cause = report.misses_by_cause  # serve's own rule on the same stream (live.py)
        report.curve = curve.to_dict()
        report.units = hitunit.unit_rows(
            parsed.requests, parsed.traces, bs, None, args.replicas, args.routing
        )
        report.notes += [f"{len(parsed.skipped)} bad lines skipped"] if parsed.skipped else []
        overlapping = args.concurrency is not None or args.arrivals
        return report, curve, report.observed.per_request_hits if overlapping else None
    tbs = args.trace_block_size or (
        blocktrace.QWEN_BLOCK if parsed.kind == "qwen" else blocktrace.MOONCAKE_BLOCK
    )
    blocktrace.check_block_sizes(bs, tbs)
    settings = {
        "block_size": bs,
        "trace_block_size": tbs,
        "num_gpu_blocks": args.num_gpu_blocks,
        "replicas": args.replicas,
        "routing": args.routing,
        "replay": analysis.replay_mode(args.concurrency, args.speed if args.arrivals else None),
    }
    report = curvereport.block_report(parsed, curve, settings)
    report["units"] = hitunit.unit_rows(parsed.requests, [], bs, tbs, args.replicas, args.routing)
    if getattr(args, "host_tier", None) is not None:
        blocks, per_token = args.host_tier
        report["host_tier"] = hosttier.two_tier_replay(
            parsed.requests, bs, args.num_gpu_blocks, blocks, args.replicas, args.routing, per_token
        ).to_dict()
    if args.concurrency is None and not args.arrivals:
        report["diagnoses"] = curvereport.block_diagnoses(report)
        return report, curve, None
    overlapping = replay.concurrent_replay(
        parsed.requests,
        bs,
        args.num_gpu_blocks,
        args.replicas,
        args.routing,
        args.max_model_len,
        args.concurrency,
        args.speed if args.arrivals else None,
        frozenset(mrc.restart_points(parsed.requests, args.restart_at)),
    )
    report["observed"] = curvereport.replay_dict(overlapping)
    report["diagnoses"] = curvereport.block_diagnoses(report)
    return report, curve, overlapping.per_request_hits


def _write_html(path: str, parsed: blocktrace.Parsed, curve: mrc.Curve, report, restart_at, hits) -> None:
    data = report if isinstance(report, dict) else report.to_dict()
    s = data["settings"]
    summary = [
        ("trace", f"{len(parsed.requests)} requests ({parsed.kind}), {curve.prompt_tokens:,} prompt tokens"),
        ("pool", f"{s['num_gpu_blocks']} blocks of {s['block_size']} tokens x {s['replicas']} replica(s)"),
        ("replay", f"{s['replay']}, {s['routing']} routing"),
        ("observed hit ratio", f"{data['observed']['hit_ratio']:.3f}"),
        ("unbounded hit ratio", f"{data['unbounded']['hit_ratio']:.3f}"),
    ]
    tier = data.get("host_tier")
    if tier is not None:
        loaded = "" if tier["load_bytes"] is None else f", {tier['load_bytes']:,.0f} bytes loaded"
        summary.append(
            (
                f"with a host tier of {tier['host_blocks']} blocks",
                f"{tier['hit_ratio']:.3f} (exact two-tier replay; {tier['host_hit_tokens']:,} tokens from "
                f"the host{loaded})",
            )
        )
    page = html.render(parsed.requests, curve, s, summary, restart_at, hits, data)
    Path(path).write_text(page, encoding="utf-8")


def _report_skipped(skipped: list[str], shown: int = 20) -> None:
    for message in skipped[:shown]:
        print(message, file=sys.stderr)
    if skipped:
        more = f" ({len(skipped) - shown} more not shown)" if len(skipped) > shown else ""
        print(f"analyze: {len(skipped)} bad lines skipped{more}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache_exporter.analyzer", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
