"""docs/accuracy.md: the confusion matrix and totals of each shape, rendered from tables, and the
committed doc is what its JSON and the seeded simulator run render (what `make check` diffs)."""

import json
from collections import Counter

from kvcache_exporter.accuracy.harness import Table
from kvcache_exporter.accuracy.report import REAL_TOTAL, columns, combined, render, summary
from kvcache_exporter.accuracy.vllm import SHAPES
from tests.conftest import REPO

TABLE = Table(
    "shape",
    {
        "uuid_first": Counter({"prefix_diverged": 9, "cold": 1}),
        "documents_reranked": Counter({"cold": 4, "content_moved": 2}),
        "append_turn": Counter({"cold": 20, "prefix_diverged": 1, "decode": 1}),
        "exact_repeat": Counter({"hit": 5}),
    },
)


def test_totals_count_injected_changes_right_and_misnamed_and_faulted_appends():
    assert summary(TABLE) == {
        "kinds": 2,
        "injected": 16,
        "right": 11,
        "cannot_show": 0,
        "appends": 22,
        "faulted_appends": 1,
        "repeats": 5,
        "repeats_hit": 5,
    }


def test_columns_put_the_attributions_causes_first_then_new_ones_then_hit_and_decode():
    # content_moved is one of the attribution's causes now (derive/attribution.py's order, cold last)
    assert columns([TABLE]) == ["prefix_diverged", "content_moved", "cold", "hit", "decode"]


def test_a_shape_renders_as_a_confusion_matrix_with_its_totals():
    text = render([(TABLE, "a note")])
    assert "| uuid_first | prefix_diverged | 10 | 9 (90%) | 9 |  | 1 |  |  |" in text
    assert "| documents_reranked | content_moved | 6 | 2 (33%) |  | 2 | 4 |  |  |" in text
    assert "Injected changes: 16 over 2 kinds; named right 11 (68.8%); misnamed 5, as: cold 5." in text
    assert "Append-only turns: 22, given a fault cause: 1." in text
    assert "| shape | 16 | 2 | 11 (68.8%) | 22 | 1 |" in text


def test_tables_survive_their_json():
    assert Table.from_json(json.loads(json.dumps(TABLE.to_json()))) == TABLE


def test_the_real_shapes_sum_into_one_row():
    other = Table(
        "other", {"uuid_first": Counter({"cold": 2}), "tools_reordered": Counter({"content_moved": 3})}
    )
    total = combined(REAL_TOTAL, [TABLE, other])
    assert summary(total) | {"repeats": 0, "repeats_hit": 0} == {
        "kinds": 3,
        "injected": 21,
        "right": 14,
        "cannot_show": 0,
        "appends": 22,
        "faulted_appends": 1,
        "repeats": 0,
        "repeats_hit": 0,
    }
    text = render([(TABLE, ""), (other, ""), (TABLE, "the simulator")], real=2)
    assert f"| {REAL_TOTAL} | 21 | 3 | 14 (66.7%) | 22 | 1 |" in text
    assert REAL_TOTAL not in render([(TABLE, ""), (other, "")], real=1)


def test_the_committed_doc_shows_the_committed_real_vllm_run():
    doc = (REPO / "docs" / "accuracy.md").read_text()
    committed = json.loads((REPO / "docs" / "accuracy-vllm.json").read_text())["tables"]
    tables = [Table.from_json(data) for data in committed]
    for table, data in zip(tables, committed, strict=True):
        s = summary(table)
        assert f"## {table.shape}" in doc and data["note"] in doc
        planned = len(SHAPES[data.get("key", "llama")].shape.kinds)  # gemma-3-window: window_dropped only
        assert (
            s["kinds"] >= min(10, planned) and f"| {table.shape} | {s['injected']:,} | {s['kinds']} |" in doc
        )
    s = summary(combined(REAL_TOTAL, tables))
    assert s["injected"] >= 2000 and s["kinds"] >= 10  # over the real servers: `make accuracy`'s full size
    if len(tables) > 1:
        assert f"| {REAL_TOTAL} | {s['injected']:,} | {s['kinds']} |" in doc
