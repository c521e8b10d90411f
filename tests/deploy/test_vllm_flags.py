"""Every vLLM command the repo ships carries the flags the README calls required (issue 31): the
list is read from the README (between `<!-- vllm-flags -->` and `<!-- /vllm-flags -->`), the
commands from the Kubernetes manifests (any container of the vLLM image), the compose file (any
service of it) and the README's own shell blocks (`vllm serve`, `python -m vllm.entrypoints...`)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VLLM_IMAGE = "vllm/vllm-openai"
KV_EVENTS = "--kv-events-config"


def required_flags() -> set[str]:
    text = README.read_text(encoding="utf-8")
    region = text.split("<!-- vllm-flags -->", 1)[1].split("<!-- /vllm-flags -->")[0]
    return set(re.findall(r"`(--[a-z][a-z-]*)`", region))


def missing(args: list[str], required: set[str]) -> list[str]:
    """The required flags `args` lacks (`--flag value` or `--flag=value`), and a KV-event config
    that does not turn the events on."""
    given = {a.split("=", 1)[0]: i for i, a in enumerate(args) if a.startswith("--")}
    out = sorted(required - set(given))
    if KV_EVENTS in given:
        i = given[KV_EVENTS]
        raw = args[i].split("=", 1)[1] if "=" in args[i] else args[i + 1]
        if json.loads(raw).get("enable_kv_cache_events") is not True:
            out.append(f'{KV_EVENTS} without "enable_kv_cache_events": true')
    return out


def _containers(doc: object) -> list[dict]:
    if isinstance(doc, dict):
        found = [c for c in doc.get("containers", []) if isinstance(c, dict)]
        return found + [c for v in doc.values() for c in _containers(v)]
    if isinstance(doc, list):
        return [c for v in doc for c in _containers(v)]
    return []


def kubernetes_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            for c in _containers(doc):
                if VLLM_IMAGE in str(c.get("image", "")):
                    out.append((f"{path.relative_to(ROOT)}:{c['name']}", [*c.get("command", []), *c["args"]]))
    return out


def compose_commands() -> list[tuple[str, list[str]]]:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    return [
        (f"docker-compose.yml:{name}", list(s["command"]))
        for name, s in services.items()
        if VLLM_IMAGE in str(s.get("image", ""))
    ]


def readme_commands() -> list[tuple[str, list[str]]]:
    out = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True) if "<<" not in command else []
            if "vllm.entrypoints.openai.api_server" in words or words[:2] == ["vllm", "serve"]:
                out.append((f"README.md: {' '.join(words[:4])} ...", words))
    return out


def shipped() -> list[tuple[str, list[str]]]:
    return kubernetes_commands() + compose_commands() + readme_commands()


def test_the_readme_lists_the_flags_and_every_place_is_found():
    assert required_flags() == {
        "--enable-prefix-caching",
        KV_EVENTS,
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "--enable-prompt-tokens-details",
    }
    places = [where for where, _ in shipped()]
    assert any(w.startswith("deploy/kubernetes/base/") for w in places), places
    assert "docker-compose.yml:vllm" in places
    assert sum(w.startswith("README.md") for w in places) >= 2, places  # the CPU recipe and `vllm serve`


@pytest.mark.parametrize(("where", "args"), shipped(), ids=[w for w, _ in shipped()])
def test_every_shipped_vllm_command_has_the_required_flags(where, args):
    assert missing(args, required_flags()) == [], where


def test_a_command_without_a_flag_or_with_events_off_is_caught():
    required = required_flags()
    events_on = '{"enable_kv_cache_events": true}'
    full = ["--model=m", *sorted(required - {KV_EVENTS}), f"{KV_EVENTS}={events_on}"]
    assert missing(full, required) == []
    assert missing([a for a in full if a != "--enable-prompt-tokens-details"], required) == [
        "--enable-prompt-tokens-details"
    ]
    off = [*full[:-1], KV_EVENTS, '{"enable_kv_cache_events": false}']
    assert missing(off, required) == [f'{KV_EVENTS} without "enable_kv_cache_events": true']
