import argparse
import subprocess
import sys

import pytest

from kvcache_exporter.cli import build_parser
from kvcache_exporter.config import ConfigError, duration, resolve, window_label
from tests.conftest import REPO

CLI = [sys.executable, "-m", "kvcache_exporter", "serve"]


def test_precedence_defaults_file_env_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("vllm:\n  url: [http://a:8000/metrics]\n  timeout: 3s\ncollect:\n  interval: 2s\n")
    env = {"KVCACHE_EXPORTER_VLLM_TIMEOUT": "4s", "KVCACHE_EXPORTER_COLLECT_WINDOWS": "1m,10m"}
    s = resolve({"vllm.timeout": "7s"}, env, str(cfg))
    assert s.vllm_url == ["http://a:8000/metrics"]  # file
    assert s.collect_interval == 2  # file
    assert s.collect_windows == [60, 600]  # env
    assert s.vllm_timeout == 7  # flag beats env and file
    assert s.web_listen_address == ":18090"  # default


def test_unknown_key_names_its_location_and_suggests(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("vllm:\n  urll: http://a/metrics\n")
    with pytest.raises(ConfigError, match=r"c.yaml:vllm.urll: unknown key \(did you mean vllm.url\?\)"):
        resolve({}, {}, str(cfg))


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"vllm.url": ["ftp://x"]}, "--vllm.url:"),
        ({"collect.interval": "5x"}, "--collect.interval: invalid duration"),
        ({"collect.windows": ["1s"], "collect.interval": "5s"}, "at least --collect.interval"),
        ({"gpu.source": "dcgm"}, "--gpu.dcgm-url"),
        ({"cost.hit_ratio_floor": "1.5"}, "not between 0 and 1"),
    ],
)
def test_bad_values_are_location_message_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve(flags, {}, None)


def test_price_table_from_flags_and_yaml(tmp_path):
    s = resolve({"cost.gpu_hour_prices": ["NVIDIA H100 80GB HBM3=2.5", "A10=0.6"]}, {}, None)
    assert s.cost_gpu_hour_prices == {"NVIDIA H100 80GB HBM3": 2.5, "A10": 0.6}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cost:\n  gpu_hour_prices:\n    NVIDIA H200: 3.1\n")
    assert resolve({}, {}, str(cfg)).cost_gpu_hour_prices == {"NVIDIA H200": 3.1}


def test_durations_and_window_labels():
    assert duration("1m30s") == 90
    assert [window_label(s) for s in (60, 300, 3600, 100, 0.5)] == ["1m", "5m", "1h", "1m40s", "500ms"]


def test_check_config_exits_0_or_2(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("vllm:\n  url: [http://127.0.0.1:8000/metrics]\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("web:\n  listen_adress: ':1'\n")
    ok = subprocess.run([*CLI, "--config.file", str(good), "--check-config"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    fail = subprocess.run([*CLI, "--config.file", str(bad), "--check-config"], capture_output=True, text=True)
    assert fail.returncode == 2
    assert "bad.yaml:web.listen_adress: unknown key (did you mean web.listen_address?)" in fail.stderr


def test_the_shipped_example_config_is_valid():
    from tests.conftest import REPO

    example = REPO / "deploy" / "exporter" / "kvcache-exporter.yaml"
    s = resolve({}, {}, str(example))
    assert s.cost_gpu_hour_prices == {"NVIDIA H100 80GB HBM3": 2.5, "default": 1.8}
    assert s.collect_windows == [60, 300, 900, 3600]
    assert s.vllm_max_body_bytes == 8 * 1024 * 1024


def test_settings_are_frozen_and_have_one_field_per_option():
    import dataclasses

    from kvcache_exporter.config import AGGREGATE_OPTIONS, OPTIONS
    from kvcache_exporter.settings import AggregateSettings, Settings

    s = resolve({}, {}, None)
    assert isinstance(s, Settings)
    for settings, options in ((Settings, OPTIONS), (AggregateSettings, AGGREGATE_OPTIONS)):
        fields = {f.name for f in dataclasses.fields(settings)} - {"source_options"}  # kit.py's rows'
        assert sorted(fields) == sorted(o.attr for o in options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.vllm_timeout = 1.0


def test_dcgm_timeout_is_its_own_option_and_pod_comes_from_the_environment():
    s = resolve({"gpu.dcgm_timeout": "2s", "vllm.timeout": "9s"}, {"POD_NAME": "vllm-0"}, None)
    assert (s.gpu_dcgm_timeout, s.vllm_timeout, s.gpu_pod) == (2, 9, "vllm-0")


def test_help_shows_durations_and_sizes_as_the_readme_writes_them():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "KVCACHE_EXPORTER_VLLM_MAX_BODY_BYTES; default 8MiB)" in flat
    assert "KVCACHE_EXPORTER_GPU_DCGM_TIMEOUT; default 5s)" in flat
    assert "KVCACHE_EXPORTER_COLLECT_WINDOWS; default 1m,5m,15m,1h)" in flat
    assert "8388608" not in flat and "5.0" not in flat


def test_help_lists_choices_and_says_each_default_once():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "--gpu.source {auto,nvml,dcgm,none}" in flat
    assert "--log.level {debug,info,warn,error}" in flat
    assert 'KVCACHE_EXPORTER_KV_EVENTS_TOPIC; default "")' in flat  # was "default )"
    assert "(default: $POD_NAME) (env KVCACHE_EXPORTER_GPU_POD)" in flat  # was also "default unset"
    assert "default )" not in flat


@pytest.mark.parametrize("command", ["serve", "simulate", "demo", "analyze", "warmup", "aggregate", "mixin"])
def test_every_flag_says_what_it_does_and_its_default(command):
    """A stranger's `--help`: no flag without a line, no default left unsaid (the walk of issue 31
    found warmup's --vllm.url bare and demo's --rate, simulate's --num-gpu-blocks without theirs)."""
    commands = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")
    parser = commands.choices[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.option_strings
        said = formatter._expand_help(action)
        if action.default not in (None, False, "", [], argparse.SUPPRESS):
            assert "default" in said, (action.option_strings, said)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--vllm.urll", "http://a/metrics"], "unrecognized arguments: --vllm.urll"),
        (["serve", "--kv-events.topc=kv"], "(did you mean --kv-events.topic?)"),
        (["serve", "--vllm.urll", "x"], "(did you mean --vllm.url?)"),
        (["aggregate", "--replicas", "a:1"], "(did you mean --replica?)"),
        (["servee"], "unknown command 'servee' (did you mean serve?)"),
    ],
)
def test_a_mistyped_flag_or_command_exits_2_with_a_suggestion(argv, said):
    run = subprocess.run([sys.executable, "-m", "kvcache_exporter", *argv], capture_output=True, text=True)
    assert run.returncode == 2
    assert said in run.stderr.splitlines()[-1]


def test_an_unknown_command_lists_the_users_commands_not_docs():
    run = subprocess.run([sys.executable, "-m", "kvcache_exporter", "nope"], capture_output=True, text=True)
    last = run.stderr.splitlines()[-1]
    assert run.returncode == 2 and "commands: serve," in last
    assert "docs" not in last and "did you mean" not in last


def test_field_patterns_from_flags_and_yaml_keep_their_commas(tmp_path):
    s = resolve({"fields.patterns": [r"ticket=TCK-\d{4,6}", "sku=[A-Z]{3}-\\d+"]}, {}, None)
    assert s.fields_patterns == {"ticket": r"TCK-\d{4,6}", "sku": "[A-Z]{3}-\\d+"}
    assert resolve({}, {"KVCACHE_EXPORTER_FIELDS_PATTERNS": r"ref=R\d{2,8}"}, None).fields_patterns == {
        "ref": r"R\d{2,8}"
    }
    cfg = tmp_path / "c.yaml"
    tiny = REPO / "tests" / "fixtures" / "tiny-llama"
    cfg.write_text(
        f"kv_events:\n  endpoint: tcp://127.0.0.1:5557\nfields:\n  tokenizer: {tiny}\n"
        "  patterns:\n    ticket: 'TCK-\\d{4,6}'\n  debug_endpoint: true\n"
    )
    s = resolve({}, {}, str(cfg))
    assert s.fields_patterns == {"ticket": r"TCK-\d{4,6}"} and s.fields_debug_endpoint is True
    assert (
        resolve({}, {}, None).fields_debug_endpoint is False
        and resolve({}, {}, None).fields_tokenizer is None
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"fleet.publish": "http://nats:4222", "kv_events.endpoint": "tcp://h:5557"}, "nats:// or tls://"),
        ({"fleet.publish": "nats://nats:4222", "kv_events.discovery": "off"}, "--kv-events.endpoint"),
        ({"fleet.publish": "nats://nats:4222", "kv_events.endpoint": "tcp://h:5557"}, "--fleet.replica"),
        ({"fleet.pool": "llama.70b"}, "letters, digits"),  # a dot would be a subject token
        ({"fleet.replica": "*"}, "letters, digits"),
        ({"fleet.hash_sampling": "0"}, "keeps no hash"),
    ],
)
def test_fleet_publishing_options_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve(flags, {}, None)


def test_fleet_replica_defaults_to_the_pod_name_when_it_is_a_subject_token():
    flags = {"fleet.publish": "tls://nats:4222", "kv_events.endpoint": "tcp://h:5557"}
    assert resolve(flags, {"POD_NAME": "vllm-0"}, None).fleet_replica == "vllm-0"
    with pytest.raises(ConfigError, match=r"--fleet\.replica"):
        resolve(flags, {"POD_NAME": "vllm.0"}, None)
