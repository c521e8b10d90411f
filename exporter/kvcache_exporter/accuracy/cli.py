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


LLAMA_NOTE_CUT = (
    "A real vLLM 0.32 CPU server (tiny Llama, dummy weights, 32-token blocks, 64-block cache), requests one "
    "at a time; the first {whole:,} of {planned:,} cases planned (kinds in turn; the run was stopped at the "
    "deadline), seed {seed}."
)
LLAMA_NOTE = (
    "A real vLLM 0.32 CPU server (tiny Llama, dummy weights, 32-token blocks, 64-block cache), requests one "
    "at a time; {cases} cases a kind, seed {seed}, {minutes:.0f} minutes; {late} requests whose events did "
    "not cover what vLLM computed within the wait."
)


def real_vllm(args: argparse.Namespace) -> dict:
    from .vllm import RealVllm, launch, llama_shape

    def measure(url: str, endpoint: str, record: IO | None) -> dict:
        backend = RealVllm(url, endpoint, llama_shape(), record=record)
        try:
            backend.warm_up()
            started = time.monotonic()
            cases = Generator(backend.shape, args.seed).cases(args.vllm_cases * len(backend.shape.kinds))
            table = tabulate(backend.shape.name, run(backend, progress(cases, len(backend.shape.kinds))))
            took = time.monotonic() - started
        finally:
            backend.close()
        done = {"minutes": took / 60, "late": backend.late}
        if record is not None:
            record.write(json.dumps(done) + "\n")
        return {**table.to_json(), "note": LLAMA_NOTE.format(cases=args.vllm_cases, seed=args.seed, **done)}

    with contextlib.ExitStack() as stack:
        record = None
        if args.vllm_record:
            record = stack.enter_context(open(args.vllm_record, "w"))
            record.write(json.dumps({"cases": args.vllm_cases, "seed": args.seed}) + "\n")
        if args.vllm_url:
            return measure(args.vllm_url, args.kv_events_endpoint, record)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="accuracy-vllm-"))
        url, endpoint = stack.enter_context(launch(Path(args.vllm_python), Path(args.model), Path(tmp)))
        return measure(url, endpoint, record)


def replayed_vllm(path: Path) -> dict:
    """The real-vLLM table again from a recorded run's events, scored by today's rules: the cases the
    recording holds whole (all of them unless the run was cut short)."""
    from .vllm import Replayed, llama_shape, load_recording

    header, recorded = load_recording(path)
    backend = Replayed(llama_shape(), recorded)
    kinds = len(backend.shape.kinds)
    planned, requests, whole = header["cases"] * kinds, 0, []
    for case in Generator(backend.shape, header["seed"]).cases(planned):
        requests += len(case)
        if requests > len(recorded):
            break
        whole.append(case)
    table = tabulate(backend.shape.name, run(backend, whole))
    if "minutes" in header:
        note = LLAMA_NOTE.format(**header)
    else:
        note = LLAMA_NOTE_CUT.format(whole=len(whole), planned=planned, seed=header["seed"])
    return {**table.to_json(), "note": note + " Scored from the run's recorded events (`--vllm-replay`)."}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache_exporter.accuracy", description=__doc__)
    parser.add_argument("--output", default="docs/accuracy.md")
    parser.add_argument("--vllm-json", default="docs/accuracy-vllm.json", help="the real-vLLM part's tables")
    parser.add_argument("--cases", type=int, default=12, help="simulator cases per kind and shape")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--vllm", action="store_true", help="run the real-vLLM part and rewrite --vllm-json")
    parser.add_argument("--vllm-cases", type=int, default=150, help="real-vLLM cases per kind")
    parser.add_argument("--vllm-url", help="a running vLLM's base URL (else one is started)")
    parser.add_argument(
        "--kv-events-endpoint", help="with --vllm-url: the endpoint its KV-event PUB connects to"
    )
    parser.add_argument(
        "--vllm-record", help="with --vllm: save every request's raw events here (JSON lines)"
    )
    parser.add_argument("--vllm-replay", help="rewrite --vllm-json from a --vllm-record file, no server")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--model", default="tests/fixtures/tiny-llama")
    args = parser.parse_args(argv)
    if args.vllm_url and not args.kv_events_endpoint:
        parser.error("--vllm-url needs --kv-events-endpoint")
    vllm_json = Path(args.vllm_json)
    if args.vllm or args.vllm_replay:
        table = replayed_vllm(Path(args.vllm_replay)) if args.vllm_replay else real_vllm(args)
        vllm_json.write_text(json.dumps({"tables": [table]}, indent=1, sort_keys=True) + "\n")
    sections = []
    if vllm_json.exists():
        sections = [
            (Table.from_json(t), t.get("note", "")) for t in json.loads(vllm_json.read_text())["tables"]
        ]
    else:
        print(f"{vllm_json} is missing: the real-vLLM part is left out (make accuracy)", file=sys.stderr)
    sections += simulated(args.cases, args.seed)
    Path(args.output).write_text(render(sections))
    return 0
