import json
import logging

from kvcache_exporter.collector import Health
from kvcache_exporter.logs import JsonFormatter, LogfmtFormatter
from kvcache_exporter.sources.base import SourceError


def record(msg, **extra):
    rec = logging.LogRecord("kvcache_exporter", logging.WARNING, __file__, 1, msg, (), None)
    rec.__dict__.update(extra)
    return rec


def test_logfmt_quotes_only_what_needs_it():
    line = LogfmtFormatter().format(record("collector failed: boom", collector="vllm", reason="timeout"))
    assert line.endswith('level=warn msg="collector failed: boom" collector=vllm reason=timeout')
    assert line.startswith("ts=20")


def test_json_lines_carry_the_same_fields():
    fields = json.loads(JsonFormatter().format(record("x", collector="gpu")))
    assert (fields["level"], fields["msg"], fields["collector"]) == ("warn", "x", "gpu")


def test_a_failing_collector_logs_once_per_reason_and_once_on_recovery(caplog):
    health = Health()
    caplog.set_level(logging.INFO, logger="kvcache_exporter")
    for _ in range(5):
        health.record("vllm", 0, 1, SourceError("timeout", "slow"))
    health.record("vllm", 0, 1, SourceError("http_status", "503"))
    health.record("vllm", 0, 1, None)
    assert [r.getMessage() for r in caplog.records] == [
        "collector failed: slow",
        "collector failed: 503",
        "collector recovered",
    ]
    assert health.errors == {"timeout": 5, "http_status": 1}
