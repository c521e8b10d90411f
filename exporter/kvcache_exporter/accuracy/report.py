"""docs/accuracy.md from the tables of a run: per shape, the confusion matrix (rows: the injected kind;
columns: the cause the sidecar named) and its totals. Pure: tables in, Markdown out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..derive.attribution import CAUSES
from .harness import DECODE, HIT, Table
from .workload import FAULTS, KINDS

HEADER = """# Attribution accuracy

<!-- Generated: `make accuracy` runs the real vLLM part (docs/accuracy-vllm.json) and the simulator
part; `make generate` reruns the simulator part and renders the vLLM part from that JSON. Do not edit. -->

Does the sidecar name the cause a miss really had? A seeded workload of multi- and single-turn chats
(token ids, `kvcache_exporter/accuracy/workload.py`) gives every scored request exactly one known
injected change, or none, and its truth. Each request is sent alone, its KV events go through the
sidecar's own path as `serve` wires it (decoder, sequence cursor, group model, miss attribution), and
the delta of `kvcache_prefix_cache_miss_tokens_total` by cause over that request is read. The cause
with the most tokens is the one *named* (a tie goes to the first by name, so `cold` beats
`prefix_diverged`); `hit` means the request added no miss tokens, `decode` that its stores were
read as decode filling a block (not a prompt miss). A case's setup requests put the
cache in a known state just before its change and are not scored; fresh random content keeps cases
apart. Causes are read from the attribution generically: a cause it learns shows up as a column.

| kind | truth | what was injected |
| --- | --- | --- |
"""

FOOTER = """
## What is not measured here, and why

- `window_dropped`: the simulator's hybrid pool evicts a unit's window blocks together with its
  full-attention block (docs/simulator.md), so it cannot drop a window part alone; the tiny Llama has
  no window. It needs the real Gemma-3 or DeepSeek-V4 shape (tests/integration/conftest.py), one more
  row for the harness.
- `host_tier_load` runs on the simulator's CPU tier only (vLLM's offloading connector does not run
  on its CPU backend); `engine_restart` on the simulator only (a real restart takes ~25 s a case;
  tests/integration/test_real_vllm_attribution.py covers it once).
- On the CPU-tier shape, `cache_reset` and `capacity_overflow` are left out: the tier loads those
  prompts back, which is `host_tier_load`'s case, not theirs.
- Prompts that are whole units are lengthened by one token for `exact_repeat`: vLLM recomputes the
  last unit of a fully cached prompt (it needs the last token's logits), so only such a prompt can
  be all hit.

Rerun: `make accuracy` starts the tiny Llama on vLLM's CPU build and sends about 5,000 requests
(the committed run: 39 minutes on two cores shared with other work, plus 2-6 minutes for vLLM to
start); `make generate` reruns only the simulator part (seeded: the same tables on every machine) and
renders the vLLM part from docs/accuracy-vllm.json, so `make check` catches a doc edited by hand or
a simulator result that moved.
"""


def columns(tables: Sequence[Table]) -> list[str]:
    """The named causes that occur, the attribution's own first, then new ones, then hit and decode."""
    seen = {cause for t in tables for counts in t.counts.values() for cause in counts}
    known = [c for c in dict.fromkeys((*CAUSES, *(cause for cause, _ in KINDS.values()))) if c in seen]
    rest = sorted(seen - set(known) - {HIT, DECODE})
    return [*[c for c in known if c not in (HIT, DECODE)], *rest, *[c for c in (HIT, DECODE) if c in seen]]


def summary(table: Table) -> dict[str, int]:
    injected = table.injected_kinds
    return {
        "kinds": len(injected),
        "injected": sum(table.scored(k) for k in injected),
        "right": sum(table.right(k) for k in injected),
        "appends": table.scored("append_turn"),
        "faulted_appends": table.faulted_appends(),
        "repeats": table.scored("exact_repeat"),
        "repeats_hit": table.right("exact_repeat") if "exact_repeat" in table.counts else 0,
    }


def misnamed_as(table: Table) -> str:
    wrong: Counter[str] = Counter()
    for kind in table.injected_kinds:
        wrong.update(table.misnamed(kind))
    return ", ".join(f"{cause} {n:,}" for cause, n in wrong.most_common()) or "none"


def shape_section(table: Table, note: str) -> str:
    cols = columns([table])
    lines = [f"## {table.shape}", "", note, ""] if note else [f"## {table.shape}", ""]
    lines.append("| injected kind | truth | scored | named right | " + " | ".join(cols) + " |")
    lines.append("| --- | --- | ---: | ---: |" + " ---: |" * len(cols))
    for kind in (k for k in KINDS if k in table.counts):
        counts = table.counts[kind]
        cells = [str(counts[c]) if counts[c] else "" for c in cols]
        right = table.right(kind)
        row = [kind, KINDS[kind][0], str(table.scored(kind)), f"{right} ({right / table.scored(kind):.0%})"]
        lines.append("| " + " | ".join([*row, *cells]) + " |")
    s = summary(table)
    lines += [
        "",
        f"Injected changes: {s['injected']:,} over {s['kinds']} kinds; named right {s['right']:,} "
        f"({s['right'] / max(s['injected'], 1):.1%}); misnamed {s['injected'] - s['right']:,}, as: "
        f"{misnamed_as(table)}. Append-only turns: {s['appends']:,}, given a fault cause: "
        f"{s['faulted_appends']:,}. Exact repeats: {s['repeats']:,}, all hit: {s['repeats_hit']:,}.",
        "",
    ]
    return "\n".join(lines)


def render(sections: Sequence[tuple[Table, str]]) -> str:
    kinds = "".join(f"| `{k}` | `{cause}` | {what} |\n" for k, (cause, what) in KINDS.items())
    rows = ["| shape | injected changes | kinds | named right | append-only turns | given a fault cause |"]
    rows.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    for table, _ in sections:
        s = summary(table)
        right = f"{s['right']:,} ({s['right'] / max(s['injected'], 1):.1%})"
        rows.append(
            f"| {table.shape} | {s['injected']:,} | {s['kinds']} | {right} | {s['appends']:,} "
            f"| {s['faulted_appends']:,} |"
        )
    faults = ", ".join(f"`{c}`" for c in sorted(FAULTS))
    body = "\n".join(shape_section(table, note) for table, note in sections)
    return (
        f"{HEADER}{kinds}\nA *fault cause* is one that tells on-call to fix something: {faults}.\n\n"
        f"## Summary\n\n" + "\n".join(rows) + "\n\n" + body + FOOTER
    )
