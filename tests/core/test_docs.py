"""README's and docs/fleet.md's flag tables are the option tables (docs.py), and stay so."""

import pytest

from kvcache_exporter import config, docs
from tests.conftest import REPO


@pytest.mark.parametrize("path", ["README.md", "docs/fleet.md"])
def test_committed_flag_tables_are_generated(path):
    text = (REPO / path).read_text()
    assert "<!-- flags:" in text
    assert docs.with_flag_tables(text) == text, f"{path} drifted: run make generate"


@pytest.mark.parametrize(
    "command,options", [("serve", config.OPTIONS), ("aggregate", config.AGGREGATE_OPTIONS)]
)
def test_every_option_is_in_the_readme(command, options):
    readme = (REPO / "README.md").read_text()
    for option in options:
        assert f"| `{option.flag}`" in readme and f"`{option.env}`" in readme


def test_a_new_option_reaches_the_table():
    table = docs.flags_markdown("serve")
    assert table.count("\n") == len(config.OPTIONS) + 1  # head, rule, one row each
    text = "x\n<!-- flags:serve -->\nstale\n<!-- /flags -->\ny\n"
    assert docs.with_flag_tables(text) == f"x\n<!-- flags:serve -->\n{table}\n<!-- /flags -->\ny\n"
