"""The mixin's config: a user's file overrides the defaults; every mistake is `location: message`."""

from __future__ import annotations

import pytest
import yaml

from kvcache_exporter.mixin import config
from tests.conftest import REPO


def load(tmp_path, text: str) -> dict:
    (path := tmp_path / "mine.yaml").write_text(text)
    return config.load(path)


def errors(tmp_path, text: str) -> list[str]:
    with pytest.raises(config.ConfigError) as caught:
        load(tmp_path, text)
    return str(caught.value).splitlines()


def test_the_shipped_defaults_are_the_repositorys_config():
    assert config.defaults() == yaml.safe_load((REPO / "alerts" / "config.yaml").read_text())


def test_no_file_and_an_empty_file_are_the_defaults(tmp_path):
    assert config.load(None) == config.defaults()
    assert load(tmp_path, "") == config.defaults()


def test_a_file_overrides_only_what_it_names(tmp_path):
    cfg = load(
        tmp_path, "urls: {runbook: https://wiki.example/kv}\nalerts:\n  KVCacheSaturated: {threshold: 0.8}\n"
    )
    want = config.defaults()
    want["urls"]["runbook"] = "https://wiki.example/kv"
    want["alerts"]["KVCacheSaturated"]["threshold"] = 0.8
    assert cfg == want


def test_lists_replace_and_their_entries_are_checked(tmp_path):
    cfg = load(tmp_path, "slo:\n  burn_rates:\n    warning: [{long: 3d, short: 6h, factor: 1}]\n")
    assert cfg["slo"]["burn_rates"]["warning"] == [{"long": "3d", "short": "6h", "factor": 1}]
    assert cfg["slo"]["burn_rates"]["critical"] == config.defaults()["slo"]["burn_rates"]["critical"]
    assert errors(tmp_path, "slo: {burn_rates: {warning: [{long: 3d, factor: 1}]}}") == [
        f"{tmp_path / 'mine.yaml'}: slo.burn_rates.warning.0: missing short"
    ]


def test_unknown_keys_and_wrong_kinds_are_each_reported_with_their_location(tmp_path):
    found = errors(
        tmp_path,
        "alerts:\n  KVCacheSaturated: {treshold: 0.8}\n  KVCacheNoSuchAlert: {for: 5m}\n"
        "hit_ratio: {windows: 5m, min_query_tokens_per_second: lots, baseline_window: 3 hours}\n"
        "evaluation_interval: -1\nurls: {runbook: 42}\n",
    )
    where = f"{tmp_path / 'mine.yaml'}: "
    assert [line.removeprefix(where).split(":")[0] for line in found] == [
        "alerts.KVCacheSaturated.treshold",
        "alerts.KVCacheNoSuchAlert",
        "hit_ratio.windows",
        "hit_ratio.min_query_tokens_per_second",
        "hit_ratio.baseline_window",
        "evaluation_interval",
        "urls.runbook",
    ]
    assert all(line.startswith(where) for line in found)
    assert "unknown key (known: " in found[0] and "threshold" in found[0]
    assert found[3].endswith("expected a number, got a string")
    assert "expected a duration such as '3h'" in found[4]


@pytest.mark.parametrize("value", [".nan", ".inf", "-0.5", "true"])
def test_thresholds_are_finite_non_negative_numbers(tmp_path, value):
    (line,) = errors(tmp_path, f"alerts: {{KVCacheSaturated: {{threshold: {value}}}}}")
    assert line.startswith(f"{tmp_path / 'mine.yaml'}: alerts.KVCacheSaturated.threshold: expected a")


def test_unreadable_and_malformed_files_are_one_line(tmp_path):
    (line,) = errors(tmp_path, "alerts: [unclosed")
    assert line.startswith(f"{tmp_path / 'mine.yaml'}: not valid YAML: ")
    with pytest.raises(config.ConfigError, match=r"nowhere\.yaml: cannot read: "):
        config.load(tmp_path / "nowhere.yaml")
    assert errors(tmp_path, "- a list") == [
        f"{tmp_path / 'mine.yaml'}: (top level): expected a mapping, got a list"
    ]
