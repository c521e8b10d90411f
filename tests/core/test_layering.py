"""The sidecar's import graph stays small: `serve` never loads the tools shipped beside it."""

import json
import subprocess
import sys

TOOLS = (
    "kvcache_exporter.simulator",
    "kvcache_exporter.analyzer",
    "kvcache_exporter.demo",
    "kvcache_exporter.aggregator",
    "kvcache_exporter.bench",
    "kvcache_exporter.soak",
    "kvcache_exporter.harness",
)

# What `kvcache-exporter serve` imports: the CLI, parsing a serve command line, the server wiring.
PROBE = """
import json, sys
from kvcache_exporter import cli
cli.build_parser("serve").parse_args(["serve", "--vllm.url", "http://127.0.0.1:1/metrics"])
import kvcache_exporter.server
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kvcache_exporter"))))
"""


def loaded(probe: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_serve_imports_none_of_the_tools():
    modules = loaded(PROBE)
    assert "kvcache_exporter.server" in modules and "kvcache_exporter.collector" in modules
    assert [m for m in modules if m.startswith(TOOLS)] == []


def test_the_check_sees_a_tool_when_one_is_imported():
    modules = loaded(PROBE.replace("import kvcache_exporter.server", "import kvcache_exporter.simulator.cli"))
    assert "kvcache_exporter.simulator" in modules
