import asyncio
import json
import os

import pytest

from kvcache_exporter.aggregator.discovery import (
    DiscoveryError,
    DnsSd,
    FileSd,
    Replica,
    bounded,
    parse_file_sd,
    parse_flag,
    resolve_host,
)


def test_flags_take_host_port_or_urls_and_an_optional_kv_endpoint():
    assert parse_flag("10.0.0.7:8000", 5557) == Replica(
        "10.0.0.7:8000", "http://10.0.0.7:8000/metrics", "tcp://10.0.0.7:5557"
    )
    assert parse_flag("https://a:9/m,tcp://b:1", 5557) == Replica("a:9", "https://a:9/m", "tcp://b:1", True)
    assert parse_flag("[::1]:8000", 5557).kv_events_endpoint == "tcp://[::1]:5557"
    assert parse_flag("a:8000", None).kv_events_endpoint is None
    for bad in ("a", "ftp://a:1", "http://:8"):
        with pytest.raises(ValueError):
            parse_flag(bad, 5557)


SD = [
    {"targets": ["10.0.0.1:8000"], "labels": {"replica": "vllm-0", "kv_events_endpoint": "tcp://10.0.0.1:7"}},
    {
        "targets": ["10.0.0.2:8000", "10.0.0.3:8000"],
        "labels": {"replica": "ignored", "__metrics_path__": "/m"},
    },
]


def test_file_sd_groups_name_replicas_from_their_labels():
    replicas = parse_file_sd(json.dumps(SD), 5557)
    assert replicas == [
        Replica("vllm-0", "http://10.0.0.1:8000/metrics", "tcp://10.0.0.1:7", kv_events_named=True),
        Replica("10.0.0.2:8000", "http://10.0.0.2:8000/m", "tcp://10.0.0.2:5557"),
        Replica("10.0.0.3:8000", "http://10.0.0.3:8000/m", "tcp://10.0.0.3:5557"),
    ]
    assert parse_file_sd("- targets: ['h:1']\n", None, yaml_format=True) == [
        Replica("h:1", "http://h:1/metrics")
    ]


@pytest.mark.parametrize(
    "text", ["{", "{}", "[1]", '[{"targets": "h:1"}]', '[{"targets": ["h"]}]', '[{"labels": {"a": 1}}]']
)
def test_bad_file_sd_is_a_parse_error(text):
    with pytest.raises(DiscoveryError) as err:
        parse_file_sd(text, 5557)
    assert err.value.reason == "parse_error"


def test_bounded_dedupes_sorts_and_caps():
    replicas = [parse_flag(f"h{i}:1", None) for i in (3, 1, 2, 1)]
    kept, left_out = bounded(replicas, 2)
    assert [r.name for r in kept] == ["h1:1", "h2:1"] and left_out == 1


def test_file_sd_is_reread_when_it_changes_and_keeps_the_last_good_list(tmp_path):
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(SD[:1]))
    sd = FileSd(str(path), 5557)

    async def body():
        first = await sd.refresh()
        path.write_text(json.dumps(SD))
        os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
        second = await sd.refresh()
        path.write_text("[{")
        with pytest.raises(DiscoveryError):
            await sd.refresh()
        path.unlink()
        with pytest.raises(DiscoveryError) as err:
            await sd.refresh()
        return first, second, err.value.reason, sd.last

    first, second, reason, last = asyncio.run(body())
    assert [r.name for r in first] == ["vllm-0"] and len(second) == 3
    assert reason == "read_error" and last == second


def test_dns_resolves_through_the_system_resolver_and_rechecks_on_its_period():
    answers = [["10.0.0.2", "10.0.0.1"], ["10.0.0.1"]]
    asked = []

    async def resolver(host):
        asked.append(host)
        if not answers:
            raise OSError("no answer")
        return answers.pop(0)

    dns = DnsSd("vllm-headless.ns.svc:8000", 5557, every=30, resolver=resolver)

    async def body():
        first = await dns.refresh(now=0)
        cached = await dns.refresh(now=10)
        second = await dns.refresh(now=31)
        with pytest.raises(DiscoveryError):
            await dns.refresh(now=62)
        return first, cached, second, await resolve_host("localhost")

    first, cached, second, local = asyncio.run(body())
    assert [r.name for r in first] == ["10.0.0.1:8000", "10.0.0.2:8000"] and cached == first
    assert [r.kv_events_endpoint for r in second] == ["tcp://10.0.0.1:5557"]
    assert asked == ["vllm-headless.ns.svc"] * 3
    assert "127.0.0.1" in local  # /etc/hosts through the real resolver, no network


def test_a_huge_file_sd_or_a_silent_resolver_is_an_error_not_a_hang(tmp_path, monkeypatch):
    import kvcache_exporter.aggregator.discovery as discovery

    path = tmp_path / "pool.json"
    path.write_text("[" + " " * 100 + "]")
    monkeypatch.setattr(discovery, "MAX_FILE_SD_BYTES", 50)
    monkeypatch.setattr(discovery, "DNS_TIMEOUT_SECONDS", 0.1)

    async def silent(host):
        await asyncio.sleep(10)

    async def body():
        reasons = []
        for source in (FileSd(str(path), None), DnsSd("vllm:8000", None, 30, resolver=silent)):
            with pytest.raises(DiscoveryError) as err:
                await source.refresh()
            reasons.append(err.value.reason)
        return reasons

    assert asyncio.run(body()) == ["too_large", "timeout"]
