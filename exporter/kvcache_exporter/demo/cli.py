"""`kvcache-exporter demo`: the simulator switching normalized -> raw -> normalized prompts -> more
templates than the cache holds, the exporter polling it and reading its KV events, Prometheus and
Alertmanager when installed, and a live view of what the exporter reports (and why the cache misses)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

from . import stack as stack_mod
from .view import (
    Narrator,
    Phase,
    _window_seconds,
    alerts_summary,
    parse_metrics,
    recent_misses,
    render_frame,
    render_line,
)

PHASES = ("normalized", "raw", "normalized", "templates")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="run simulator + exporter (+ Prometheus/Alertmanager) with a live view",
        description=__doc__,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--phase-seconds", type=float, default=90.0, help="wall seconds per phase (default 90)")
    add("--speed", type=float, default=1.0, help="simulator speed-up: simulated seconds per wall second")
    add("--rate", type=float, default=5.0, help="simulated requests per simulated second")
    add("--duration", type=float, help="stop after this many seconds (default: run until Ctrl-C)")
    add("--refresh", type=float, default=2.0, help="seconds between view refreshes (default 2)")
    add("--collect-interval", default="1s", help="exporter poll interval (default 1s)")
    add(
        "--window",
        dest="windows",
        action="append",
        help="exporter sliding window, repeatable (default: a third of a phase, at most 30s, and 5m)",
    )
    add("--gpu-hour-price", type=float, default=2.5, help="price of a GPU-hour, for cost metrics")
    add("--currency", default="USD", help="currency of that price, shown beside every cost (default USD)")
    add("--no-prometheus", action="store_true", help="do not start Prometheus/Alertmanager even if installed")
    add(
        "--fleet", action="store_true", help="a simulated 4-replica pool and the aggregator's view (fleet.md)"
    )
    add(
        "--fleet.transport",
        dest="fleet_transport",
        choices=("zmq", "nats"),
        default="zmq",
        help="with --fleet: zmq, the aggregator subscribes to every replica (default); nats, each "
        "replica's sidecar publishes to a local nats-server (JetStream) the aggregator reads",
    )
    add("--block-size", type=int, default=16, help="simulator KV block size in tokens")
    add("--num-gpu-blocks", type=int, default=2048, help="simulator KV blocks")


def default_windows(phase_seconds: float) -> list[str]:
    short = int(max(3, min(30, phase_seconds // 3)))
    return [f"{short}s", "5m"]


def phase_at(elapsed: float, phase_seconds: float, reported: str | None) -> Phase:
    index = min(int(elapsed // phase_seconds), len(PHASES) - 1)
    in_phase = elapsed - index * phase_seconds
    left = phase_seconds - in_phase if index < len(PHASES) - 1 else None
    return Phase(reported or PHASES[index], index + 1, len(PHASES), in_phase, left)


def run(args: argparse.Namespace) -> int:
    if args.phase_seconds <= 0 or args.speed <= 0 or args.refresh <= 0:
        print("demo: --phase-seconds, --speed and --refresh must be positive", file=sys.stderr)
        return 2
    if args.fleet_transport != "zmq" and not args.fleet:
        print("demo: --fleet.transport applies to --fleet only", file=sys.stderr)
        return 2
    if args.fleet:
        from . import fleet

        return fleet.run(args)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = stack_mod.Stack()
    tty = sys.stdout.isatty()
    code = 0
    try:
        code = _run(args, stack, stop, tty)
    except RuntimeError as err:
        _say(f"demo: {err}", sys.stderr)
        code = 1
    except BrokenPipeError:  # the reader went away (`| head`): stop as for Ctrl-C
        _silence_stdout()
    finally:
        _say(("\n" if tty else "") + "demo: stopping ...")
        stack.stop()  # whatever the prints did: children and the temp dir never outlive the demo
        _say("demo: stopped, temporary files removed")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _say(text: str, stream=None) -> None:
    """Print, unless the reader is gone: a closed pipe must not keep the demo from cleaning up."""
    try:
        print(text, file=stream or sys.stdout, flush=True)
    except (BrokenPipeError, ValueError):
        _silence_stdout()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so later writes and the exit flush do not fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _run(args: argparse.Namespace, stack: stack_mod.Stack, stop: threading.Event, tty: bool) -> int:
    sim_phase = f"{args.phase_seconds * args.speed:g}s"
    schedule = f"normalized:{sim_phase},raw:{sim_phase},normalized:{sim_phase},templates"
    kv_events = f"tcp://127.0.0.1:{stack_mod.free_port()}"
    sim_extra = ["--block-size", str(args.block_size), "--num-gpu-blocks", str(args.num_gpu_blocks)]
    sim_extra += ["--kv-cache-metrics"]  # vLLM's residency histograms, for the "cache too small" story
    sim_extra += ["--kv-events-endpoint", kv_events]
    sim = stack.start_simulator(schedule, args.speed, args.rate, sim_extra)
    started = time.monotonic()
    windows = args.windows or default_windows(args.phase_seconds)
    exporter = stack.start_exporter(
        sim.url, args.collect_interval, windows, args.gpu_hour_price, kv_events, args.currency
    )
    urls = {"simulator": sim.url, "exporter": exporter.url}
    prometheus_bin = stack_mod.which(stack_mod.PROMETHEUS_NAMES)
    alertmanager_bin = stack_mod.which(stack_mod.ALERTMANAGER_NAMES)
    prometheus_running = False
    if not args.no_prometheus and prometheus_bin:
        am_url = None
        if alertmanager_bin:
            try:
                am_url = stack.start_alertmanager(alertmanager_bin).url
                urls["alertmanager"] = am_url
            except RuntimeError as err:
                stack.notes.append(f"alertmanager not started: {err}")
        try:
            # Rules scaled so that a 15-minute story fits one phase: a 90 s phase runs them 10x faster.
            scale = min(1.0, args.phase_seconds / 900)
            urls["prometheus"] = stack.start_prometheus(
                prometheus_bin, exporter.url, sim.url, am_url, scale
            ).url
            prometheus_running = True
        except RuntimeError as err:
            stack.notes.append(f"prometheus not started: {err}")
    absent = None
    if not prometheus_running:
        absent = "Prometheus not installed" if not prometheus_bin else "Prometheus not running"
        absent = "Prometheus disabled (--no-prometheus)" if args.no_prometheus else absent
    print(f"demo: schedule {schedule} at speed {args.speed:g} (phases of {args.phase_seconds:g}s wall)")
    for name, url in urls.items():
        print(f"demo: {name:<12} {url}")
    if absent:
        print(f"demo: {absent}")
    for note in stack.notes:
        print(f"demo: note: {note}")
    print(f"demo: temp dir {stack.workdir}", flush=True)

    recent: list[tuple[float, object]] = []  # (time, snapshot): misses are shown over the short window
    short = _window_seconds(windows[0]) or 30.0
    narrator = Narrator(short)  # line mode's phase, why, action and worth
    while not stop.is_set():
        now = time.monotonic()
        elapsed = now - started
        if args.duration is not None and elapsed >= args.duration:
            break
        for service in stack.services.values():
            if service.proc.poll() is not None:
                raise RuntimeError(
                    f"{service.name} exited ({service.proc.returncode}):\n{stack.log_tail(service.name)}"
                )
        reported = None
        try:
            reported = json.loads(stack_mod.http_get(sim.url + "/control/state")).get("workload")
        except (OSError, ValueError):
            pass
        try:
            snap = parse_metrics(stack_mod.http_get(exporter.url).decode())
        except (OSError, ValueError):
            snap = None
        firing, pending = alerts_summary(stack.alerts() if prometheus_running else None, absent)
        phase = phase_at(elapsed, args.phase_seconds, reported)
        if snap is not None:
            recent.append((now, snap))
            while len(recent) > 1 and recent[1][0] <= now - short:
                recent.pop(0)
        misses = recent_misses(recent[0][1], snap) if recent else None
        if tty:
            sys.stdout.write(render_frame(elapsed, phase, snap, firing, pending, urls, misses))
        else:
            sys.stdout.write("".join(line + "\n" for line in narrator.tell(phase, misses, snap)))
            sys.stdout.write(render_line(elapsed, phase, snap, firing, pending, misses) + "\n")
        sys.stdout.flush()
        wait = args.refresh - (time.monotonic() - now)
        if args.duration is not None:
            wait = min(wait, args.duration - (time.monotonic() - started))
        stop.wait(max(wait, 0.0))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache_exporter.demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
