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
