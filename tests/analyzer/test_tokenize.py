"""Text traces tokenized with a real tokenizer: a tiny BPE trained here (the `tokenizers` library, offline),
its chat template rendered with Jinja2 as vLLM renders it, and the tiny-llama fixture's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from kvcache_exporter.analyzer import trace
from kvcache_exporter.analyzer.tokenize import ModelTokenizer

TINY_LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}"
    "[/{{ m['role'] | upper }}]"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
CORPUS = [
    "You are a helpful support agent for an online shop. Answer politely and briefly.",
    "Where is my order? It was due yesterday and the tracking page shows nothing.",
    "Can I return shoes that I already wore once outside?",
] * 20


@pytest.fixture(scope="module")
def tiny_bpe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bpe")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    bpe.train_from_iterator(CORPUS, trainer)
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    bpe.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_prompts_and_chats_use_the_model_tokenizer(tiny_bpe):
    model = ModelTokenizer(tiny_bpe)
    raw = Tokenizer.from_file(str(tiny_bpe / "tokenizer.json"))
    bos = raw.token_to_id("<s>")
    assert model.encode(CORPUS[1]) == [bos, *raw.encode(CORPUS[1], add_special_tokens=False).ids]
    messages = [{"role": "system", "content": CORPUS[0]}, {"role": "user", "content": CORPUS[2]}]
    rendered = model.render_chat(messages)
    assert rendered == f"<s>[SYSTEM]{CORPUS[0]}[/SYSTEM][USER]{CORPUS[2]}[/USER][ASSISTANT]"
    ids = trace.parse_trace_line({"messages": messages}, 0, encoder=model).prompt_token_ids
    assert ids == raw.encode(rendered, add_special_tokens=False).ids and ids.count(bos) == 1


def test_tiny_llama_template_and_tokenizer():
    model = ModelTokenizer(TINY_LLAMA)
    messages = [{"role": "user", "content": "hello there"}]
    assert model.render_chat(messages) == "user: hello there\nassistant:"
    assert model.encode_chat(messages) and model.encode_chat(messages) != model.encode("hello there")


def test_analyze_an_openai_log_with_the_tokenizer(tiny_bpe, tmp_path):
    system = {"role": "system", "content": CORPUS[0] * 4}
    lines = [
        {
            "messages": [system, {"role": "user", "content": f"order {n}: " + CORPUS[1 + n % 2]}],
            "user": f"u{n}",
        }
        for n in range(30)
    ]
    lines.append({"prompt": "not json's fault"})
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{broken\n")
    argv = [
        sys.executable,
        "-m",
        "kvcache_exporter.analyzer",
        str(path),
        "--block-size",
        "4",
        "--format",
        "json",
    ]
    exact = subprocess.run(
        [*argv, "--tokenizer", str(tiny_bpe / "tokenizer.json")], capture_output=True, text=True
    )
    assert exact.returncode == 0, exact.stderr
    assert "approximate" not in exact.stderr and f"{path}:32: " in exact.stderr
    model = ModelTokenizer(tiny_bpe)
    tokens = sum(len(model.encode_chat(line["messages"])) for line in lines[:30]) + len(
        model.encode(lines[30]["prompt"])
    )
    report = json.loads(exact.stdout)
    assert report["observed"]["prompt_tokens"] == tokens
    assert report["observed"]["hit_ratio"] > 0.5  # the shared system prompt
    rough = subprocess.run(argv, capture_output=True, text=True)
    assert rough.returncode == 0 and "approximate" in rough.stderr
    assert json.loads(rough.stdout)["observed"]["prompt_tokens"] != tokens


def test_the_analyzer_names_the_first_per_request_field_as_the_sidecar_does(tmp_path):
    """The seed's header first (`User [ID:..] at <timestamp> asks about order [NO:..]:`), then shared
    content: the dynamic part is named an id (the user id, the first field past the shared head), its
    shape redacted; the diagnosis says so. Without --tokenizer nothing is named."""
    rng = random.Random(4)
    system = " ".join(CORPUS[:3]) * 2
    lines = [
        {
            "prompt": f"User [ID:{rng.randrange(10**4, 10**5)}] at 2026-12-{rng.randrange(1, 29):02d}T"
            f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:00 asks about order "
            f"[NO:{rng.randrange(10**6, 10**7)}]: {system}"
        }
        for _ in range(40)
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [
        sys.executable,
        "-m",
        "kvcache_exporter.analyzer",
        str(path),
        "--block-size",
        "16",
        "--format",
        "json",
    ]
    done = subprocess.run([*argv, "--tokenizer", str(TINY_LLAMA)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    field = report["structure"]["dynamic_field"]
    assert field["field"] == "id", field
    assert field["shape"].startswith("<Word> <id> <word> <timestamp>"), field  # `asks about order` is shared
    assert "User" not in field["shape"] and "asks" not in field["shape"]
    [dynamic] = [d for d in report["diagnoses"] if d["kind"] == "dynamic_prefix"]
    assert "The first per-request field reads as an id (" in dynamic["evidence"]
    rough = json.loads(subprocess.run(argv, capture_output=True, text=True).stdout)
    assert rough["structure"]["dynamic_field"]["field"] is None
