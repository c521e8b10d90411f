import argparse

from kvcache_exporter.simulator import cli


def test_simulate_subcommand_builds_a_config():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--listen", "[::1]:0", "--engines", "2", "--metrics-schema", "v0",
                              "--schedule", "normalized:60s,raw:60s", "--fault-metrics-fail"])  # fmt: skip
    config = cli.config_from_args(args)
    assert (config.host, config.port, config.engines, config.metrics_schema) == ("::1", 0, 2, "v0")
    assert config.faults.metrics_fail and args.func is cli.run


def test_bad_schedule_exits_with_2(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--schedule", "nope:1s"])) == 2
    assert "nope" in capsys.readouterr().out


def deployment(*argv: str):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.config_from_args(parser.parse_args(list(argv)))


def test_deployment_shape_options():
    config = deployment("--layout", "deepseek-v4", "--data-parallel-size", "2", "--api-server-count", "2",
                        "--lora-adapters", "a,b", "--session-ids",
                        "--kv-cache-report-mode", "full")  # fmt: skip
    assert (config.engine.layout, config.engine.block_size, config.engines) == ("deepseek-v4", 256, 2)
    assert (config.api_server_count, config.lora_adapters, config.session_ids) == (2, ("a", "b"), True)
    assert config.kv_cache_report_mode == "full"
    assert deployment("--layout", "gemma-3").engine.block_size == 32
    tier = deployment("--offload-cpu-bytes", str(10 * 16 * 131072)).engine
    assert (tier.offload_cpu_blocks, tier.offload_block_bytes) == (10, 16 * 131072)


def test_bad_deployment_options_exit_with_2(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for argv in (["--lora-adapters", "a,a"], ["--offload-cpu-bytes", "100"]):
        assert cli.run(parser.parse_args(argv)) == 2
    assert "--offload-cpu-bytes" in capsys.readouterr().out
