"""Every `kvcache-exporter ...` command in README.md and docs/*.md parses with the CLI's real parser
(issue 23: docs showed `kvcache-exporter --kv-events.endpoint ...` without `serve`).

Commands are taken from shell code blocks (``` with no language, sh, bash, shell or console; a
screen capture goes in ```text) and from inline code spans that start with the command. Nothing is
run: each one's arguments go through build_parser().parse_args, so options added later are checked
against what the parser really accepts. A synopsis may mark optional parts [like this] (checked with
them) and placeholders <like-this>; a line ending in `...` (and so on) is not a command.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

from kvcache_exporter.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
PROGRAMS = (("kvcache-exporter",), (".venv/bin/kvcache-exporter",), ("python", "-m", "kvcache_exporter"))
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&"}


def shell_snippets(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every shell code block's logical line and every inline code span."""
    snippets, fence, lines = [], None, text.splitlines()
    pending, start = "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = line.strip()[3:].strip() if fence is None else None
            continue
        if fence is not None:
            if fence in SHELL_FENCES:
                start = start or number
                pending += line.rstrip().removesuffix("\\") + " "
                if not line.rstrip().endswith("\\"):
                    snippets.append((start, pending.strip().removeprefix("$ ")))
                    pending, start = "", 0
            continue
        snippets += [(number, span) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line)]
    return snippets


def arguments(snippet: str) -> list[str] | None:
    """The CLI's arguments if the snippet runs kvcache-exporter, else None."""
    snippet = re.sub(r"<([^<>\s]+)>", r"\1", snippet).replace("[", " ").replace("]", " ")
    try:
        words = shlex.split(snippet, comments=True)
    except ValueError:
        return None
    for i in range(len(words)):
        for program in PROGRAMS:
            starts = i == 0 or words[i - 1] == "$" or "=" in words[i - 1]  # a prompt, VAR=value
            if starts and tuple(words[i : i + len(program)]) == program:
                rest = words[i + len(program) :]
                cut = next((j for j, w in enumerate(rest) if w in SHELL_OPERATORS), len(rest))
                return None if "..." in rest[:cut] else rest[:cut]
    return None


@functools.cache
def parser():
    return build_parser()


def commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for number, snippet in shell_snippets(path.read_text(encoding="utf-8")):
            args = arguments(snippet)
            if args is not None:
                found.append((f"{path.relative_to(ROOT)}:{number}", args))
    return found


def test_the_docs_show_commands_to_check():
    places = {where.split(":")[0] for where, _ in commands()}
    assert {"README.md", "docs/fleet.md", "docs/kv-events.md", "docs/analyzer.md"} <= places


@pytest.mark.parametrize(("where", "args"), commands(), ids=[w for w, _ in commands()])
def test_every_documented_command_parses(where, args):
    if len(args) <= 1 and not any(a.startswith("-") for a in args):  # `kvcache-exporter warmup` in prose
        subcommands = next(a for a in parser()._actions if a.dest == "command").choices
        assert not args or args[0] in subcommands, f"{where}: no subcommand {args[0]!r}"
        return
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parser().parse_args(args)
        except SystemExit as stop:
            if stop.code != 0:
                pytest.fail(f"{where}: kvcache-exporter {shlex.join(args)}: {err.getvalue()}", pytrace=False)


def test_a_command_without_its_subcommand_is_caught():
    args = arguments("$ kvcache-exporter --kv-events.endpoint tcp://h:5557  # as docs/kv-events.md had it")
    assert args == ["--kv-events.endpoint", "tcp://h:5557"]
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as stop:
        parser().parse_args(args)
    assert stop.value.code == 2


def test_help_speaks_to_users_and_hides_the_maintainers_docs_command():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    listed = {line.split()[0] for line in out.getvalue().splitlines() if line.startswith("    ")}
    assert {"serve", "aggregate", "mixin"} <= listed and "docs" not in listed
    assert "docs" not in out.getvalue().split("\n")[0] and "exits the process" not in out.getvalue()
    assert parser().parse_args(["docs", "--output", "-"]).output == "-"  # `make generate` still runs it
