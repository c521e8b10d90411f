"""The sidecar's reorder estimate per layout (derive/layouts.py) against the real outcome of each layout.

The seed's real vLLM 0.32 run: its raw phase (header first) read by serve's rule (analyzer/live.py), the
estimate for the header at the very end against the real normalized phase (the same requests with the
header last: vLLM's own cached tokens), and for the header right after the template against the exact
replay of that layout (the simulator's engine reproduces the real run's hits request for request). A chat
log with the time first in the system message, against the same requests sent with the time at the very
end or after the instructions (exact replays of the real layouts, not of the analyzer's own reorder)."""

from __future__ import annotations

import json

import pytest

from kvcache_exporter.analyzer import analysis, live, reorder, tokenize, trace
from kvcache_exporter.analyzer.replay import replay
from tests.conftest import REPO
from tests.derive.test_attribution_real import SEED, phase_ratio

from .chats import timestamp_first_chat

TINY = REPO / "tests" / "fixtures" / "tiny-llama"


def test_the_seed_estimates_each_layout_it_did_not_run():
    lines = [
        line for line in (SEED / "trace.jsonl").read_text().splitlines() if json.loads(line)["phase"] == "raw"
    ]
    raw = trace.parse_trace(lines)
    seen = live.live_view(raw, 32, 96)
    hits, queries = phase_ratio("normalized")  # the same requests, header last, on the real server
    layouts = reorder.layouts([r.prompt_token_ids for r in raw], 32)
    after = replay(analysis.reordered(raw, layouts, reorder.reorder_after_template), 32, 96).hit_ratio
    assert abs(seen.layout_estimate("end") - hits / queries) <= 0.03, (seen.reorder_tokens, hits / queries)
    assert abs(seen.layout_estimate("after_template") - after) <= 0.03, (seen.reorder_tokens, after)
    assert hits / queries - after > 0.05  # questions recur behind the template: the layouts differ


@pytest.mark.parametrize("blocks", [512, 4096])
def test_a_timestamp_first_chat_estimates_each_fixed_layout(blocks):
    model = tokenize.ModelTokenizer(TINY)

    def requests(where: str) -> list[trace.TraceRequest]:
        lines = timestamp_first_chat(where=where)
        return [trace.parse_trace_line(json.loads(line), i, 16, model) for i, line in enumerate(lines)]

    seen = live.live_view(requests("first"), 32, blocks)
    end, after = (replay(requests(where), 32, blocks).hit_ratio for where in ("end", "after_template"))
    assert abs(seen.layout_estimate("end") - end) <= 0.03, (seen.layout_estimate("end"), end)
    assert abs(seen.layout_estimate("after_template") - after) <= 0.03, (seen.reorder_tokens, after)
    assert seen.reordered_estimate - end > 0.03  # all known content behind the field: too high here
