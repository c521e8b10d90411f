"""The sidecar's import graph stays small: `serve` never loads the tools shipped beside it."""

import ast
import json
import subprocess
import sys

from tests.conftest import REPO

TOOLS = (
    "kvcache_exporter.simulator",
    "kvcache_exporter.analyzer",
    "kvcache_exporter.demo",
    "kvcache_exporter.aggregator",
    "kvcache_exporter.mixin",
    "kvcache_exporter.tools",
    "kvcache_exporter.accuracy",
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


def test_serve_loads_pyzmq_and_yaml_only_for_the_features_that_need_them():
    # memory (docs/memory.md): ~2 MiB of RSS for a sidecar without KV events or config files
    probe = PROBE.replace('m.startswith("kvcache_exporter")', 'm.split(".")[0] in ("zmq", "yaml")')
    assert loaded(probe) == []
    with_events = probe.replace("import kvcache_exporter.server", "import kvcache_exporter.sources.kv_events")
    assert "zmq" in loaded(with_events)  # the check sees them when they are imported


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in it, lazy imports included)."""
    root = REPO / "exporter" / "kvcache_exporter"
    paths = {".".join(p.relative_to(root.parent).with_suffix("").parts): p for p in root.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in paths.items()}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*parts, node.module] if node.module else parts)
                submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                deps |= submodules or {target}  # `from . import x` imports x, not the package again
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for dep in sorted(graph[module]):
            if dep in path:
                found.append([*path[path.index(dep) :], dep])
            elif dep not in done:
                visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "kvcache_exporter.sources.gpu" in graph["kvcache_exporter.sources.nvml"]
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]  # the check can fail


# The folders are the layers. derive/ sees the sources only through their snapshot types; nothing below
# the tools imports a tool; the endpoint knows neither sources nor derivations.
SNAPSHOT_TYPES = {
    "kvcache_exporter.sources.vllm_snapshot",
    "kvcache_exporter.sources.vllm_names",
    "kvcache_exporter.sources.gpu",
    "kvcache_exporter.sources.kv_events_decode",
}
FOLDER_RULES = {  # package -> the packages its modules may not import
    "kvcache_exporter.sources": ("kvcache_exporter.derive", "kvcache_exporter.web"),
    "kvcache_exporter.derive": (  # durations and window labels come from durations.py, not config
        "kvcache_exporter.sources",
        "kvcache_exporter.web",
        "kvcache_exporter.server",
        "kvcache_exporter.config",
    ),
    "kvcache_exporter.web": ("kvcache_exporter.sources", "kvcache_exporter.derive"),
}
SIDECAR = ("kvcache_exporter.sources", "kvcache_exporter.derive", "kvcache_exporter.web")


def folder_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for module, deps in graph.items():
        for package, banned in FOLDER_RULES.items():
            if module.startswith(package + "."):
                bad += [(module, d) for d in deps if d.startswith(banned) and d not in SNAPSHOT_TYPES]
        if module.startswith(SIDECAR):
            bad += [(module, d) for d in deps if d.startswith(TOOLS)]
    return sorted(bad)


def test_the_folders_are_the_layers():
    graph = import_graph()
    assert folder_violations(graph) == []
    broken = {**graph, "kvcache_exporter.derive.cache": {"kvcache_exporter.sources.vllm"}}
    assert folder_violations(broken) == [("kvcache_exporter.derive.cache", "kvcache_exporter.sources.vllm")]


def test_the_derivations_load_no_http_client():
    probe = """
import json, sys
import kvcache_exporter.derive.registry, kvcache_exporter.derive.state
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("aiohttp", "zmq", "yaml"))))
"""
    assert loaded(probe) == []
