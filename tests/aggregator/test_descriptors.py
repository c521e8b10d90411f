"""The aggregator's open-file budget (issue 33 item 1): what a replica costs in each layout, what is
kept for our own /metrics and the polls, and who is left unsubscribed when the limit is reached."""

import asyncio
import logging

from kvcache_exporter.aggregator.descriptors import BASE_FDS, SCRAPE_RESERVE, FdBudget
from kvcache_exporter.aggregator.discovery import Replica, StaticSd
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings


def pod(i: int) -> str:
    return f"tcp://10.{i // 250}.0.{i % 250 + 1}:5557"


def one_host(i: int) -> str:
    return f"tcp://10.0.0.1:{6000 + i}"


def fill(budget: FdBudget, endpoint, replicas: int) -> int:
    return sum(budget.take(f"r{i:04d}", endpoint(i)) for i in range(replicas))


def test_a_thousand_pods_fit_in_1024_with_room_for_scrapes_and_a_poll():
    budget = FdBudget(1024)
    assert fill(budget, pod, 1000) == 1000
    assert budget.in_use() == BASE_FDS + 1000 + 1  # a connection each, one shared lane
    assert budget.in_use() + SCRAPE_RESERVE + budget.poll_slots() <= 1024
    assert budget.poll_slots() >= 1


def test_one_host_costs_two_a_replica_and_the_rest_wait():
    budget = FdBudget(1024)
    subscribed = fill(budget, one_host, 1000)
    assert subscribed == (1024 - BASE_FDS - SCRAPE_RESERVE - 1) // 2  # a lane (an eventfd) + a connection
    assert budget.lanes() == subscribed
    assert budget.poll_slots() == 1024 - budget.in_use() - SCRAPE_RESERVE >= 1
    assert budget.full() == (budget.poll_slots() == 1)


def test_host_names_get_a_lane_each_and_two_ranks_of_one_pod_two_lanes():
    budget = FdBudget(1024)
    budget.take("a", "tcp://vllm-0.pool:5557")
    budget.take("b", "tcp://vllm-1.pool:5557")
    budget.take("c0", "tcp://10.0.0.1:5557")
    budget.take("c1", "tcp://10.0.0.1:5558")  # a second rank on the same pod
    budget.take("d", "tcp://10.0.0.2:5557")  # fits on an existing shared lane
    assert budget.lanes() == 4 and budget.in_use() == BASE_FDS + 5 + 4


def test_a_replica_gone_frees_room_for_one_waiting():
    budget = FdBudget(BASE_FDS + SCRAPE_RESERVE + 1 + 2 * 3)
    assert fill(budget, one_host, 5) == 3
    assert not budget.take("r0003", one_host(3))
    budget.release("r0001")
    assert budget.take("r0003", one_host(3)) and not budget.take("r0004", one_host(4))


def test_the_poll_slots_follow_what_is_held_when_more_is_open_than_counted():
    budget = FdBudget(1024)
    fill(budget, pod, 100)
    assert budget.poll_slots() == 64
    assert budget.poll_slots(held=1000) == 1024 - 1000 - SCRAPE_RESERVE


def test_a_metrics_url_naming_a_host_budgets_the_resolver_too():
    budget = FdBudget(1024)
    fill(budget, pod, 1000)
    budget.set_poll_urls(["http://10.0.0.1:8000/metrics", "http://[fd00::1]:8000/metrics"])
    assert budget.poll_fds == 1 and budget.poll_slots() == 1024 - budget.in_use() - SCRAPE_RESERVE
    budget.set_poll_urls(["http://10.0.0.1:8000/metrics", "http://vllm-1.pool:8000/metrics"])
    assert budget.poll_fds == 2 and budget.poll_slots() == (1024 - budget.in_use() - SCRAPE_RESERVE) // 2
    by_name = FdBudget(1024, poll_fds=2)
    assert fill(by_name, pod, 1100) == fill(FdBudget(1024), pod, 1100) - 1  # its second one is kept too


def replicas(n: int) -> list[Replica]:
    """On one host, all refusing (loopback ports nobody listens on)."""
    return [Replica(f"r{i:04d}", "http://127.0.0.1:1/metrics", f"tcp://127.0.0.1:{i + 1}") for i in range(n)]


def test_the_aggregator_names_fd_exhausted_and_logs_it_once(caplog):
    limit = BASE_FDS + SCRAPE_RESERVE + 1 + 2 * 4  # room for four replicas on one host

    async def run() -> tuple[list, list]:
        sd = StaticSd(replicas(6))
        aggregator = Aggregator(PoolSettings(interval=0.1, timeout=1.0), [sd], fd_limit=limit)
        try:
            await aggregator.poll_once()
            await aggregator.poll_once()
            first = aggregator.latest
            sd.last = replicas(6)[2:]  # two gone: the two waiting subscribe
            await aggregator.poll_once()
            return first, aggregator.latest
        finally:
            await aggregator.close()

    with caplog.at_level(logging.INFO, logger="kvcache_exporter.aggregate"):
        first, after = asyncio.run(run())
    refused = {
        s.labels["replica"]: s.value
        for s in first
        if s.name == "kvcache_exporter_errors_total" and s.labels.get("reason") == "fd_exhausted"
    }
    assert refused == {"r0004": 2.0, "r0005": 2.0}  # one a poll it went without events
    assert all(
        s.labels["collector"] == "kv_events" for s in first if s.labels.get("reason") == "fd_exhausted"
    )
    still = {s.labels["replica"]: s.value for s in after if s.labels.get("reason") == "fd_exhausted"}
    assert still == refused  # subscribed now: the counter stops, it does not go back
    warnings = [r for r in caplog.records if "fd_exhausted" in r.getMessage()]
    assert len(warnings) == 1 and "2 replicas" in warnings[0].getMessage()
    assert warnings[0].getMessage().endswith("by 4")  # two on one IP address, two descriptors each
    assert any("subscribed again" in r.getMessage() for r in caplog.records)


def test_the_left_out_warning_is_logged_once_and_again_when_it_changes(caplog):
    async def run() -> None:
        sd = StaticSd(replicas(3))
        aggregator = Aggregator(PoolSettings(max_replicas=2), [sd])
        try:
            for _ in range(5):
                await aggregator.poll_once()
            sd.last = replicas(4)  # now two left out
            for _ in range(5):
                await aggregator.poll_once()
        finally:
            await aggregator.close()

    with caplog.at_level(logging.WARNING, logger="kvcache_exporter.aggregate"):
        asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert said == [
        "more replicas than --replica.max: 1 left out",
        "more replicas than --replica.max: 2 left out",
    ]
