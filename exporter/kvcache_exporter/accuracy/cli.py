"""`python -m kvcache_exporter.accuracy`: docs/accuracy.md.

Without `--vllm` (what `make generate` runs) the simulator part is run again and the real-vLLM part
is rendered from the committed JSON of the last real run; `--vllm` (what `make accuracy` runs) runs
that part on a real vLLM too (started here unless `--vllm-url` names a running one) and rewrites the
JSON first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .harness import Table, run, tabulate
from .report import render
from .simulated import SHAPES, Simulated
from .workload import Generator

SEED = 29
NOTE_SIM = (
    "The simulator in process ({layout} layout, {unit}-token hit unit, {tokens:,}-token GPU cache{tier})."
)


def simulated(cases_per_kind: int, seed: int) -> list[tuple[Table, str]]:
    out = []
    for spec in SHAPES:
        backend = Simulated(spec)
        cases = Generator(backend.shape, seed).cases(cases_per_kind * len(backend.shape.kinds))
        tier = f", {spec.offload_blocks * spec.block_size:,}-token CPU tier" if spec.offload_blocks else ""
        note = NOTE_SIM.format(
            layout=spec.layout, unit=spec.block_size, tokens=backend.shape.capacity_tokens, tier=tier
        )
        out.append((tabulate(spec.name, run(backend, cases)), note))
    return out


def progress(cases: Iterator[list], every: int) -> Iterator[list]:
    """The cases, a line on stderr every `every` x 10 of them (a full real-vLLM run takes a while)."""
    for i, case in enumerate(cases):
        if i and i % (every * 10) == 0:
            print(f"{i} cases sent", file=sys.stderr, flush=True)
        yield case


NOTE_CUT = (
    "A real vLLM 0.32 CPU server ({described}), requests one at a time; the first {whole:,} of {planned:,} "
    "cases planned (kinds in turn; the run was stopped at the deadline), seed {seed}."
)
NOTE = (
    "A real vLLM 0.32 CPU server ({described}), requests one at a time; {cases} cases a kind, seed {seed}, "
    "{minutes:.0f} minutes; {late} requests whose events did not cover what vLLM computed within the wait."
)


def real_vllm(args: argparse.Namespace, key: str) -> dict:
    """One shape's table from a run on a real vLLM (started here unless `--vllm-url` names one); its
    events recorded in `--vllm-record`/<shape>.jsonl as it goes."""
    from .vllm import SHAPES, RealVllm, launch

    spec = SHAPES[key]
    per_kind = args.vllm_cases or spec.cases

    def measure(url: str, endpoints: list[str], record: IO | None) -> dict:
        backend = RealVllm(url, endpoints, spec, record=record)
        try:
            backend.warm_up()
            started = time.monotonic()
            cases = Generator(backend.shape, args.seed).cases(per_kind * len(backend.shape.kinds))
            table = tabulate(backend.shape.name, run(backend, progress(cases, len(backend.shape.kinds))))
            took = time.monotonic() - started
        finally:
            backend.close()
        done = {"minutes": took / 60, "late": backend.late}
        if record is not None:
            record.write(json.dumps(done) + "\n")
        note = NOTE.format(described=spec.described, cases=per_kind, seed=args.seed, **done)
        return {**table.to_json(), "key": key, "note": note}

    with contextlib.ExitStack() as stack:
        record = None
        if args.vllm_record:
            Path(args.vllm_record).mkdir(parents=True, exist_ok=True)
            record = stack.enter_context(open(Path(args.vllm_record) / f"{key}.jsonl", "w"))
            record.write(json.dumps({"shape": key, "cases": per_kind, "seed": args.seed}) + "\n")
        if args.vllm_url:
            return measure(args.vllm_url, args.kv_events_endpoint, record)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"accuracy-vllm-{key}-"))
        url, endpoints = stack.enter_context(launch(Path(args.vllm_python), spec, Path(tmp)))
        print(f"vLLM {key} answering at {url}", file=sys.stderr, flush=True)
        return measure(url, endpoints, record)


def replayed_vllm(path: Path) -> dict:
    """A shape's table again from a recorded run's events, scored by today's rules: the cases the
    recording holds whole (all of them unless the run was cut short). The recording's first line names
    its shape (one without a name is the tiny Llama's, round 4's)."""
    from .vllm import SHAPES, Replayed, load_recording

    header, recorded = load_recording(path)
    key = header.get("shape", "llama")
    spec = SHAPES[key]
    backend = Replayed(spec.shape, recorded)
    kinds = len(backend.shape.kinds)
    planned, requests, whole = header["cases"] * kinds, 0, []
    for case in Generator(backend.shape, header["seed"]).cases(planned):
        requests += len(case)
        if requests > len(recorded):
            break
        whole.append(case)
    table = tabulate(backend.shape.name, run(backend, whole))
    if "minutes" in header:
        note = NOTE.format(described=spec.described, **header)
    else:
        note = NOTE_CUT.format(
            described=spec.described, whole=len(whole), planned=planned, seed=header["seed"]
        )
    note += " Scored from the run's recorded events (`--vllm-replay`)."
    return {**table.to_json(), "key": key, "note": note}


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """The real-vLLM tables, one a shape in SHAPES' order: `new` ones replace their shape's old one."""
    from .vllm import SHAPES

    by_key = {t.get("key", "llama"): t for t in old} | {t["key"]: t for t in new}
    return [by_key[key] for key in SHAPES if key in by_key]


def main(argv: list[str] | None = None) -> int:
    from .vllm import SHAPES

    parser = argparse.ArgumentParser(prog="python -m kvcache_exporter.accuracy", description=__doc__)
    parser.add_argument("--output", default="docs/accuracy.md")
    parser.add_argument("--vllm-json", default="docs/accuracy-vllm.json", help="the real-vLLM part's tables")
    parser.add_argument("--cases", type=int, default=12, help="simulator cases per kind and shape")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--vllm", action="store_true", help="run the real-vLLM part and rewrite --vllm-json")
    parser.add_argument(
        "--shape",
        action="append",
        choices=list(SHAPES),
        help="with --vllm: the deployment shape to run, one server after another (repeatable; default all)",
    )
    parser.add_argument(
        "--vllm-cases", type=int, help="real-vLLM cases per kind (default: each shape's full size)"
    )
    parser.add_argument("--vllm-url", help="a running vLLM's base URL (else one is started)")
    parser.add_argument(
        "--kv-events-endpoint",
        action="append",
        help="with --vllm-url: the endpoint its KV-event PUB connects to (one a DP rank, in rank order)",
    )
    parser.add_argument(
        "--vllm-record", help="with --vllm: a folder; every request's raw events go to <shape>.jsonl in it"
    )
    parser.add_argument(
        "--vllm-replay",
        nargs="+",
        metavar="RECORDING",
        help="rewrite these shapes' tables in --vllm-json from --vllm-record files (one a shape), no server",
    )
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    args = parser.parse_args(argv)
    if args.vllm_url and not args.kv_events_endpoint:
        parser.error("--vllm-url needs --kv-events-endpoint")
    if args.vllm_url and len(args.shape or ()) != 1:
        parser.error("--vllm-url needs exactly one --shape (the running server's)")
    vllm_json = Path(args.vllm_json)
    old = json.loads(vllm_json.read_text())["tables"] if vllm_json.exists() else []
    if args.vllm_replay:
        new = [replayed_vllm(Path(path)) for path in args.vllm_replay]
        vllm_json.write_text(json.dumps({"tables": merged(old, new)}, indent=1, sort_keys=True) + "\n")
    elif args.vllm:
        for key in args.shape or SHAPES:  # written after each shape: a later one failing keeps the earlier
            old = merged(old, [real_vllm(args, key)])
            vllm_json.write_text(json.dumps({"tables": old}, indent=1, sort_keys=True) + "\n")
    sections = []
    if vllm_json.exists():
        sections = [
            (Table.from_json(t), t.get("note", "")) for t in json.loads(vllm_json.read_text())["tables"]
        ]
    else:
        print(f"{vllm_json} is missing: the real-vLLM part is left out (make accuracy)", file=sys.stderr)
    real = len(sections)
    sections += simulated(args.cases, args.seed)
    Path(args.output).write_text(render(sections, real))
    return 0
