"""The served model's tokenizer, shared by the analyzer and the sidecar's field naming: loading
(the tiny-llama fixture, a folder or its file; bad files refused with the reason) and a decoder
that never raises on hostile ids (the fuzz twin: tests/derive/test_fields_fuzz.py)."""

from pathlib import Path

import pytest

from kvcache_exporter.model_tokenizer import MAX_FILE_BYTES, load_tokenizer, safe_decoder

TINY_LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"


@pytest.mark.parametrize("path", [TINY_LLAMA, TINY_LLAMA / "tokenizer.json"])
def test_loads_a_folder_or_its_tokenizer_json(path):
    tokenizer = load_tokenizer(path)
    text = "User [ID:48213] at 2026-12-04T13:49:58"
    assert safe_decoder(tokenizer, 64)(tokenizer.encode(text).ids) == text


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file"), (b"{not json", "not a tokenizer.json"), (b"\xff\xfe", "utf-8")],
)
def test_a_bad_file_is_refused_with_the_reason(tmp_path, content, message):
    if content is not None:
        (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tmp_path)


def test_a_huge_file_is_not_read(tmp_path):
    big = tmp_path / "tokenizer.json"
    with big.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing written
    with pytest.raises(ValueError, match="not a tokenizer file"):
        load_tokenizer(big)


def test_the_decoder_skips_hostile_ids_and_stops_at_its_bound():
    tokenizer = load_tokenizer(TINY_LLAMA)
    decode = safe_decoder(tokenizer, 4)
    ids = tokenizer.encode("abc def").ids
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    hostile = [-1, vocab, 2**64, 10**40, 3.5, "7", None, True, *ids]
    assert decode(hostile) == ""  # the first 4 are all out of range: the bound is on ids looked at
    assert decode([*ids, -5, vocab]) == tokenizer.decode(ids[:4], skip_special_tokens=True)
    assert decode([1, 2]) == ""  # <s>, </s>: special tokens are dropped
