"""Real `serve` processes fed KV events by real ZMQ publishers, for the hostile and heavy tests: one
way to start them, to publish to them and to read what they export."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvcache_exporter.tools.harness import Service, Services, free_port, wait_showing

_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", re.M)


@dataclass
class KvServe:
    exporter: Service
    kv_port: int  # serve binds tcp://127.0.0.1:kv_port, as for vLLM's concrete endpoint

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.exporter.port}/metrics"


def kv_serve(services: Services, *more: str) -> KvServe:
    """A simulated vLLM polled every 0.5 s by `serve`, which binds a KV-event endpoint; up once the
    first poll is in."""
    simulator = services.simulator("--rate", "5")
    kv_port = free_port()
    exporter = services.exporter(
        "--vllm.url", f"http://127.0.0.1:{simulator.port}/metrics", "--gpu.source", "none",
        "--collect.interval", "0.5s", "--kv-events.endpoint", f"tcp://127.0.0.1:{kv_port}", *more,
    )  # fmt: skip
    served = KvServe(exporter, kv_port)
    wait_showing(served.url, "kvcache_vllm_up 1.0")
    return served


def xpub(ctx: zmq.Context) -> zmq.Socket:
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # nothing dropped on our side: whatever is lost, the exporter lost
    pub.setsockopt(zmq.LINGER, 0)
    return pub


def subscribed(pub: zmq.Socket) -> None:
    """XPUB: wait for the exporter's subscription, so no batch is lost before it arrives."""
    pub.setsockopt(zmq.RCVTIMEO, 30_000)
    assert pub.recv()[:1] == b"\x01"


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for metric, labels, value in _SAMPLE.findall(text):
        if metric == name:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def value(text: str, name: str, **labels: str) -> float:
    return sum(v for got, v in samples(text, name) if labels.items() <= got.items())


def scrape_until(url: str, done: Callable[[str], bool], seconds: float = 60.0) -> str:
    deadline, text = time.monotonic() + seconds, ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        if done(text):
            return text
        time.sleep(0.3)
    return text
