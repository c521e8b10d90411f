"""Tests mirror the sidecar's modules: `pkg/mod.py` is tested in tests/<folder>/test_mod.py, or the
exception below says which tests cover it instead (one place to look, kept honest both ways)."""

from tests.conftest import REPO

PACKAGE = REPO / "exporter" / "kvcache_exporter"
FOLDERS = {"": "core", "sources": "sources", "derive": "derive", "web": "web"}  # the sidecar's layers

# module -> the test files that cover it (a mirror of its own would repeat them)
COVERED_ELSEWHERE = {
    "cli.py": ["core/test_serve.py", "core/test_config.py"],
    "exposition.py": ["core/test_golden.py", "core/test_endpoint.py"],
    "server.py": ["core/test_serve.py", "core/test_faults.py"],
    "service.py": ["core/test_serve.py", "core/test_config_errors.py", "aggregator/test_cli.py"],
    "samples.py": ["core/test_guard.py"],
    "settings.py": ["core/test_config.py"],
    "sources/base.py": ["core/test_collector.py"],
    "sources/http_stream.py": ["sources/test_http.py"],
    "sources/gpu.py": ["sources/test_nvml.py", "derive/test_gpu.py"],
    "sources/gpu_factory.py": ["sources/test_nvml.py", "sources/test_dcgm.py"],
    "sources/kv_events_decode.py": ["sources/test_kv_events.py", "sources/test_kv_events_hostile.py"],
    "sources/vllm_names.py": ["sources/test_vllm.py"],
    "sources/vllm_parse.py": ["sources/test_vllm.py", "sources/test_textformat_fuzz.py"],
    "sources/sglang_parse.py": ["sources/test_sglang.py"],
    "sources/vllm_snapshot.py": ["sources/test_vllm.py"],
    "derive/cache.py": ["derive/test_windows.py", "sources/test_vllm.py"],
    "derive/cache_config.py": ["derive/test_audit.py"],
    "derive/fingerprints.py": ["derive/test_attribution.py"],
    "derive/kv_budget.py": ["sources/test_kv_events_heavy.py", "sources/test_kv_events_fuzz.py"],
    "derive/kv_events.py": ["sources/test_kv_events.py", "derive/test_registry.py"],
    "derive/state.py": ["core/test_collector.py"],
    "derive/targets.py": ["derive/test_targets_fuzz.py"],
    "derive/whatif.py": ["derive/test_attribution_host_tier.py"],
    "web/app.py": ["core/test_endpoint.py"],
    "web/auth.py": ["core/test_endpoint.py"],
    "web/listener.py": ["core/test_endpoint.py"],
    "web/config.py": ["core/test_webconfig.py"],
    # a source's declarations (its kit) and its wiring: the rows' test, the golden exposition, config
    "metric.py": ["core/test_catalog.py", "core/test_guard.py"],
    "options.py": ["core/test_config.py", "core/test_config_errors.py"],
    "source_rows.py": ["core/test_golden.py", "core/test_serve.py", "core/test_kit.py"],
    "kv_event_rows.py": ["core/test_golden.py", "core/test_kv_event_streams.py", "core/test_kit.py"],
    "fleet_view_kit.py": ["core/test_catalog.py", "core/test_docs.py"],
    "fleet_publish_kit.py": ["core/test_kit.py", "core/test_fleet_publish.py", "core/test_config.py"],
    "sources/engine_kit.py": ["core/test_kit.py", "core/test_config_errors.py", "core/test_golden.py"],
    "sources/gpu_kit.py": ["core/test_kit.py", "core/test_config_errors.py", "core/test_golden.py"],
    "sources/kv_events_kit.py": ["core/test_kit.py", "core/test_config_errors.py", "core/test_golden.py"],
    "derive/cost_kit.py": ["core/test_kit.py", "derive/test_cost.py"],
    "derive/audit_kit.py": ["core/test_kit.py", "derive/test_audit.py"],
}


def sidecar_modules() -> list[str]:
    out = []
    for folder in FOLDERS:
        out += [
            str(p.relative_to(PACKAGE))
            for p in sorted((PACKAGE / folder).glob("*.py"))
            if p.name not in ("__init__.py", "__main__.py")
        ]
    return out


def mirror(module: str) -> str:
    folder, _, name = module.rpartition("/")
    return f"{FOLDERS[folder]}/test_{name}"


def problems(modules: list[str], tests: set[str], covered: dict[str, list[str]]) -> list[str]:
    out = []
    for module in modules:
        has_mirror = mirror(module) in tests
        if module in covered:
            out += [f"{module}: {t} does not exist" for t in covered[module] if t not in tests]
            if has_mirror:
                out.append(f"{module}: has {mirror(module)}, drop its exception")
        elif not has_mirror:
            out.append(f"{module}: no tests/{mirror(module)} and no exception")
    out += [f"{m}: exception for a module that does not exist" for m in covered if m not in modules]
    return out


def test_every_sidecar_module_has_its_tests():
    tests = {str(p.relative_to(REPO / "tests")) for p in (REPO / "tests").rglob("test_*.py")}
    assert len(sidecar_modules()) > 40
    assert problems(sidecar_modules(), tests, COVERED_ELSEWHERE) == []
    # the check can fail: a new module without tests, a stale exception
    assert problems(["derive/new.py"], tests, {}) == [
        "derive/new.py: no tests/derive/test_new.py and no exception"
    ]
    assert problems(["catalog.py"], tests, {"catalog.py": ["core/test_catalog.py"]}) == [
        "catalog.py: has core/test_catalog.py, drop its exception"
    ]
