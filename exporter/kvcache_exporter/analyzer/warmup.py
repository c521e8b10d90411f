"""`kvcache-exporter warmup --from TRACE --top K --vllm.url URL [--dry-run]`: after a restart, send the
trace's K most reused prefixes once each (max_tokens 1) so the server starts with them cached."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import blocktrace
from .replay import replay
from .trace import TraceRequest


@dataclass(frozen=True)
class Prefix:
    token_ids: list[int]
    requests: int
    """requests of the trace that start with it"""

    @property
    def score(self) -> int:
        """tokens it would have saved: reuse x length"""
        return (self.requests - 1) * len(self.token_ids)


def top_prefixes(requests: Sequence[TraceRequest], block_size: int, top: int) -> list[Prefix]:
    """The K prefix-tree branch points (whole blocks, where requests diverge) with the most reuse x length."""
    ids = blocktrace.Interner()
    users: dict[int, int] = defaultdict(int)
    widest_child: dict[int, int] = defaultdict(int)
    example: dict[int, tuple[int, int]] = {}
    for n, r in enumerate(requests):
        chain = blocktrace.from_tokens(r, block_size, ids).groups
        for depth, group in enumerate(chain[: (len(r.prompt_token_ids) - 1) // block_size], 1):
            users[group] += 1
            example.setdefault(group, (n, depth))
            if depth > 1:
                widest_child[chain[depth - 2]] = max(widest_child[chain[depth - 2]], users[group])
    candidates = []
    for group, count in users.items():
        if count > 1 and widest_child[group] < count:
            n, depth = example[group]
            candidates.append(Prefix(requests[n].prompt_token_ids[: depth * block_size], count))
    candidates.sort(key=lambda p: -p.score)
    return candidates[:top]


def hit_ratio_after_restart(
    requests: Sequence[TraceRequest],
    warm: Sequence[Prefix],
    block_size: int,
    num_gpu_blocks: int,
    seconds: float = 60.0,
) -> float:
    """Hit ratio of the requests sent in the first `seconds` after a restart (an empty cache), with the
    `warm` prefixes sent first: the simulator's engine, one request at a time."""
    start = next((r.send_ts for r in requests if r.send_ts is not None), 0.0)
    window = [r for r in requests if r.send_ts is None or r.send_ts - start < seconds]
    primers = [TraceRequest(list(p.token_ids), 1, index=-1) for p in warm]
    result = replay(primers + window, block_size, num_gpu_blocks)
    hits = result.per_request_hits[len(primers) :]
    tokens = sum(len(r.prompt_token_ids) for r in window)
    return sum(hits) / tokens if tokens else 0.0


def send(url: str, prefixes: Sequence[Prefix], model: str | None, timeout: float) -> int:
    """POST each prefix to /v1/completions (max_tokens 1); returns the cached tokens vLLM reported."""
    base = url.rstrip("/")
    if model is None:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout) as answer:
            model = json.load(answer)["data"][0]["id"]
    cached = 0
    for prefix in prefixes:
        body = json.dumps({"model": model, "prompt": prefix.token_ids, "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            usage = json.load(answer).get("usage") or {}
        cached += ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return cached


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("warmup", help="preload a trace's most reused prefixes into vLLM")
    add = parser.add_argument
    add("--from", dest="trace", required=True, help="token-id trace (JSON lines, as for analyze)")
    add("--top", type=int, default=10, help="how many prefixes (default 10)")
    add("--vllm.url", dest="url", default="http://127.0.0.1:8000", help="vLLM's base URL")
    add("--model", help="model name (default: the first of /v1/models)")
    add("--block-size", type=int, default=16, help="vLLM's block size: prefixes are whole blocks")
    add("--timeout", type=float, default=60.0, help="seconds per request")
    add("--dry-run", action="store_true", help="print the prefixes, send nothing")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        if args.top < 1 or args.block_size < 1:
            raise ValueError("--top and --block-size must be at least 1")
        lines = Path(args.trace).read_text(encoding="utf-8").splitlines()
        parsed = blocktrace.parse_lines(lines, args.trace, args.block_size)
        for message in parsed.skipped[:20]:
            print(message, file=sys.stderr)
        if parsed.kind != "tokens":
            raise ValueError("warm-up sends prompts: it needs a token-id (or text) trace, not block hashes")
        prefixes = top_prefixes(parsed.traces, args.block_size, args.top)
        for n, p in enumerate(prefixes, 1):
            head = " ".join(map(str, p.token_ids[:12]))
            print(
                f"{n:3d}. {len(p.token_ids):6d} tokens, {p.requests:5d} requests, "
                f"score {p.score}: [{head} ...]"
            )
        if args.dry_run:
            return 0
        cached = send(args.url, prefixes, args.model, args.timeout)
        print(f"warmup: sent {len(prefixes)} prefixes to {args.url} ({cached} tokens were already cached)")
    except (OSError, ValueError, KeyError) as err:
        print(f"warmup: {err}", file=sys.stderr)
        return 2
    return 0
