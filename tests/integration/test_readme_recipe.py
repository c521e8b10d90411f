"""The README's "Try it on a real vLLM" recipe, run as written (issue 31): the shell blocks between
`<!-- recipe -->` and `<!-- /recipe -->`, each in a bash of its own as a reader pastes them, only
the ports swapped for free ones. The first block installs (nothing, once installed) and starts the
real vLLM CPU build, the second the exporter with `--vllm.url` alone (it finds the KV-event endpoint
at vLLM's /kv_event_sources; its listen port, not in the block, comes from the environment); the
third sends the prompts and greps the exporter, whose answer must carry the why: hits, the KV-event
stream and the miss causes, prefix_diverged among them for the prompts that put per-request fields
first. KVCACHE_TEST_RECIPE_OUT names a folder to keep the three outputs in (for the docs).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from kvcache_exporter.tools.harness import Service, StartError, free_port, stop

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VLLM_START_TIMEOUT_S = float(os.environ.get("KVCACHE_TEST_VLLM_START_TIMEOUT", "420"))
PORTS = ("8000", "5557", "18090")  # vLLM's HTTP, its KV-event endpoint, the exporter's


def recipe_blocks() -> list[str]:
    region = README.read_text(encoding="utf-8").split("<!-- recipe -->", 1)[1].split("<!-- /recipe -->", 1)[0]
    return re.findall(r"```sh\n(.*?)```", region, re.S)


def on_ports(block: str, ports: dict[str, int]) -> str:
    for written, free in ports.items():
        block = re.sub(rf"\b{written}\b", str(free), block)
    return block


def value(metrics: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for line in metrics.splitlines():
        head, _, number = line.rpartition(" ")
        family = head.split("{", 1)[0]
        if family == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(number)
    return total


def test_recipe_blocks_are_the_three_shells():
    blocks = recipe_blocks()
    assert len(blocks) == 3
    assert "vllm.entrypoints.openai.api_server" in blocks[0] and "kvcache-exporter serve" in blocks[1]
    assert all(port in "".join(blocks) for port in PORTS)


def test_the_exporter_block_is_one_flag():
    """Zero configuration beside vLLM: `serve --vllm.url URL`, nothing copied from vLLM's flags."""
    command = recipe_blocks()[1].replace("\\\n", " ").split()
    assert command == [".venv/bin/kvcache-exporter", "serve", "--vllm.url", "http://127.0.0.1:8000/metrics"]


def test_the_readme_recipe_reaches_the_why_on_real_vllm(tmp_path):
    ports = {written: free_port() for written in PORTS}
    vllm_block, exporter_block, prompts_block = (on_ports(b, ports) for b in recipe_blocks())
    env = {  # kept apart from other runs' caches; the recipe's own variables are in its text
        **os.environ,
        "TMPDIR": str(tmp_path),
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "HF_HOME": str(tmp_path / "hf"),
        "VLLM_NO_USAGE_STATS": "1",
        "KVCACHE_EXPORTER_WEB_LISTEN_ADDRESS": f"127.0.0.1:{ports['18090']}",
    }
    env.pop("VIRTUAL_ENV", None)
    started: list[subprocess.Popen] = []

    def shell(name: str, block: str, port: int) -> Service:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", block],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(proc)
        return Service(name, port, proc, log)

    try:
        vllm = shell("vllm", vllm_block, ports["8000"])
        vllm.wait_answering("/health", VLLM_START_TIMEOUT_S)
        exporter = shell("exporter", exporter_block, ports["18090"])
        exporter.wait_answering("/metrics", 30)
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", prompts_block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except StartError as err:
        pytest.fail(str(err), pytrace=False)
    finally:
        for proc in reversed(started):
            stop(proc)
    keep = os.environ.get("KVCACHE_TEST_RECIPE_OUT")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for log in ("vllm.log", "exporter.log"):
            Path(keep, log).write_bytes((tmp_path / log).read_bytes())
        Path(keep, "prompts.out").write_text(run.stdout + run.stderr, encoding="utf-8")
    assert run.returncode == 0, run.stderr
    exporter_log = (tmp_path / "exporter.log").read_text(encoding="utf-8", errors="replace")
    found = f"KV events from vLLM's /kv_event_sources: rank 0 tcp://127.0.0.1:{ports['5557']} (bind)"
    assert found in exporter_log, exporter_log
    usages = [line for line in run.stdout.splitlines() if line.startswith("{")]
    cached = [int(n) for n in re.findall(r"'cached_tokens': (\d+)", "\n".join(usages))]
    assert len(usages) == 10 and len(cached) == 10, run.stdout
    assert cached[0] == 0 and all(n > 0 for n in cached[1:5]), cached  # vLLM found the prefix
    metrics = run.stdout
    assert value(metrics, "kvcache_vllm_up") == 1, metrics
    assert value(metrics, "kvcache_prefix_cache_hit_ratio", window="1m") > 0, metrics
    assert value(metrics, "kvcache_kv_events_total", type="BlockStored") > 0, metrics
    assert value(metrics, "kvcache_prefix_cache_miss_tokens_total", cause="cold") > 0, metrics
    assert value(metrics, "kvcache_prefix_cache_miss_tokens_total", cause="prefix_diverged") > 0, metrics
