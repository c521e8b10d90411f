"""One simulator workload per miss cause, each with varying-length dynamic fields, through the
simulator's block pool and its real KV-event wire encoding into the classifier."""

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request
from kvcache_exporter.simulator.kv_events import encode_batch
from kvcache_exporter.simulator.workloads import WorkloadFactory
from kvcache_exporter.sources.kv_events_decode import decode_message


class Publisher:
    """An engine whose every step's events go through the wire format, seq counting from 0."""

    def __init__(self, attribution: Attribution, blocks: int = 2048, events: EventState | None = None):
        self.engine = Engine(EngineConfig(16, blocks, max_model_len=4096, max_num_batched_tokens=8192), 0)
        self.attribution, self.seq, self.clock = attribution, 0, 0.0
        self.events = events or EventState()  # reads the sequence, as in serve

    def run(self, workload, requests: int, answers: bool = False) -> None:
        """`answers`: generate each request's max_tokens and hand them back (chat), one at a time."""
        for i in range(requests):
            spec = workload.next_request()
            request = Request(str(i), spec.prompt_token_ids, spec.max_tokens if answers else 1, self.clock)
            self.engine.add_request(request)
            while self.engine.has_work:
                step = self.engine.step(self.clock)
                self.clock += step.duration
                frames = [b"kv", self.seq.to_bytes(8, "big"), encode_batch(step.events, 0, self.clock)]
                batch = decode_message(frames, with_tokens=True)
                self.attribution.apply(batch, self.events.apply(batch))
                self.seq += 1
            if answers:
                workload.on_response(spec, request.output_token_ids)


def shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    delta = {cause: after[cause] - before.get(cause, 0) for cause in after}
    total = sum(delta.values())
    return {cause: n / total for cause, n in delta.items() if n}


def test_header_first_prompts_are_prefix_diverged():
    factory, attribution = WorkloadFactory(seed=3), Attribution()
    Publisher(attribution).run(factory.make("raw"), 150)
    assert shares({}, attribution.totals.tokens)["prefix_diverged"] > 0.75  # 0.84: 16-token blocks


def test_header_last_prompts_hit_and_their_misses_are_cold():
    factory, attribution = WorkloadFactory(seed=3), Attribution()
    Publisher(attribution).run(factory.make("normalized"), 150)
    got = shares({}, attribution.totals.tokens)
    assert got["cold"] > 0.8 and got.get("prefix_diverged", 0) < 0.2, got


def test_more_templates_than_the_cache_holds_are_evicted():
    factory, attribution = WorkloadFactory(seed=3), Attribution()
    publisher = Publisher(attribution)
    workload = factory.make("templates")
    publisher.run(workload, 60)  # the first pass over the 40 templates is cold
    before = dict(attribution.totals.tokens)
    publisher.run(workload, 120)
    got = shares(before, attribution.totals.tokens)
    assert got["evicted"] > 0.6, got


def test_a_restarted_publisher_recomputes_restart_blocks():
    factory, attribution, events = WorkloadFactory(seed=3), Attribution(), EventState()
    Publisher(attribution, events=events).run(factory.make("normalized"), 40)
    before = dict(attribution.totals.tokens)
    Publisher(attribution, events=events).run(factory.make("normalized"), 40)  # seq from 0, empty cache
    got = shares(before, attribution.totals.tokens)
    assert events.restarts == 1 and got["restart"] == max(got.values()), got  # headers: cold


def test_raw_headers_in_a_real_tokenizer_name_their_user_id_field():
    """With --tokenizer the raw header is text (`User [ID:48213] at 2026-...`): the sidecar's field
    namer, decoding with the same tokenizer, names the user id that breaks the prefix."""
    from pathlib import Path

    from kvcache_exporter.derive.front_fields import MAX_FRONT_TOKENS, FrontFields
    from kvcache_exporter.model_tokenizer import load_tokenizer, safe_decoder

    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"
    factory, attribution = WorkloadFactory(seed=3, tokenizer_path=str(tiny)), Attribution()
    decode = safe_decoder(load_tokenizer(tiny), MAX_FRONT_TOKENS)
    attribution.fields = fields = FrontFields(decode, per_second=10**6, timer=lambda: 0.0)  # every front
    Publisher(attribution).run(factory.make("raw"), 100)
    assert shares({}, attribution.totals.tokens)["prefix_diverged"] > 0.75
    assert fields.tokens["id"] == attribution.totals.tokens["prefix_diverged"] > 0
    assert {seen["field"] for seen in fields.report()["recent"]} == {"id"}


def test_a_template_that_drops_the_reasoning_is_history_rewritten_and_a_verbatim_one_is_cold():
    factory, attribution = WorkloadFactory(seed=3), Attribution()
    Publisher(attribution).run(factory.make("chat_rewritten"), 60, answers=True)
    got = shares({}, attribution.totals.tokens)
    assert got["history_rewritten"] > 0.3, got
    verbatim = Attribution()
    Publisher(verbatim).run(WorkloadFactory(seed=3).make("chat"), 60, answers=True)
    assert shares({}, verbatim.totals.tokens).keys() == {"cold"}  # append-only: never a fault


def test_reranked_documents_are_content_moved():
    factory, attribution = WorkloadFactory(seed=3), Attribution()
    Publisher(attribution).run(factory.make("documents"), 60)
    got = shares({}, attribution.totals.tokens)
    # 0.08 (prefix_diverged 0.11: a seam at the divergence point reads as a per-request front; cold
    # 0.81: the first requests, the recurring questions, seams without an anchor); docs/kv-events.md
    assert got["content_moved"] > 0.05 and got.keys() <= {"content_moved", "prefix_diverged", "cold"}, got
