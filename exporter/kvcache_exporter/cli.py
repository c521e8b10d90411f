"""`kvcache-exporter`: the only place that parses arguments and exits the process."""

from __future__ import annotations

import argparse
import difflib
import sys

from . import __version__, config, docs

DESCRIPTION = """Prometheus exporter for vLLM's KV (prefix) cache: run `serve` beside vLLM and scrape it.
The other commands are tools around it. `kvcache-exporter COMMAND --help` lists a command's flags."""
EXAMPLE = "example: kvcache-exporter serve --vllm.url http://127.0.0.1:8000/metrics"


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="poll vLLM (and the GPU, and the KV-event stream) and serve the derived metrics",
        description="Every flag has an environment twin (KVCACHE_EXPORTER_<FLAG>) and a --config.file key.",
    )
    config.add_options(serve, config.OPTIONS)  # with every registered source's (kit.py)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from . import service
    from .server import build_exporter

    return service.main(args, config.OPTIONS, config.resolve, build_exporter)


def _docs(args: argparse.Namespace) -> int:
    for path in args.flag_tables or ():
        with open(path, encoding="utf-8") as f:
            text = docs.with_flag_tables(f.read())
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if args.flag_tables:
        return 0
    text = docs.metrics_markdown()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


SIDECAR_COMMANDS = ("serve", "docs")
HIDDEN_COMMANDS = ("docs",)  # for maintainers: never offered to users


def _did_you_mean(word: str, names: list[str]) -> str:
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _with_defaults(formatter: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """`formatter` naming every flag's default that its help does not already name."""

    class WithDefaults(formatter):  # type: ignore[misc, valid-type]
        def _get_help_string(self, action: argparse.Action) -> str | None:
            text = action.help
            unsaid = action.default in (None, False, "", [], argparse.SUPPRESS) or not action.option_strings
            if text is None or unsaid or "default" in text:
                return text
            return f"{text} (default %(default)s)"

    return WithDefaults


class Parser(argparse.ArgumentParser):
    """argparse with a did-you-mean for a mistyped flag or command (Python 3.12's suggest_on_error
    is not in 3.11), without the maintainers' `docs` in the commands an error lists, and with
    every flag's default in its help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["formatter_class"] = _with_defaults(kwargs.get("formatter_class", argparse.HelpFormatter))
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        command = getattr(parsed, "command", None)
        if extras and command and self._subparsers is not None:
            sub = next(a for a in self._subparsers._group_actions if a.dest == "command").choices[command]
            flag = next((e for e in extras if e.startswith("-")), extras[0])
            hint = _did_you_mean(flag.split("=", 1)[0], list(sub._option_string_actions))
            sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed, extras

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("argument COMMAND: invalid choice:"):
            word = message.split("'")[1]
            commands = next(a for a in self._actions if a.dest == "command").choices
            offered = [c for c in commands if c not in HIDDEN_COMMANDS]
            hint = _did_you_mean(word, offered)
            message = f"unknown command '{word}'{hint}; commands: {', '.join(offered)}"
        super().error(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All subcommands; for `serve` and `docs` only those, so the sidecar never imports the tools
    (simulator, analyzer, demo, aggregate, mixin): tests/core/test_layering.py holds this."""
    parser = Parser(prog="kvcache-exporter", description=DESCRIPTION, epilog=EXAMPLE)
    parser.add_argument("--version", action="version", version=f"kvcache-exporter {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(subparsers)
    # For maintainers (`make generate`): no help= keeps it out of the list users read.
    doc = subparsers.add_parser("docs", description="write docs/metrics.md from the metric catalog")
    doc.add_argument("--output", default="-", help="file to write (default stdout)")
    doc.add_argument(
        "--flag-tables", action="append", help="rewrite the flags:COMMAND tables of this file instead"
    )
    doc.set_defaults(func=_docs)
    for module in _subcommand_modules() if command not in SIDECAR_COMMANDS else ():
        module.register(subparsers)  # each sets func= on its parser
    return parser


def _subcommand_modules() -> list:
    from .aggregator import cli as aggregate
    from .analyzer import cli as analyze
    from .analyzer import warmup
    from .demo import cli as demo
    from .mixin import cli as mixin
    from .simulator import cli as simulate

    return [simulate, demo, analyze, warmup, aggregate, mixin]


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    command = next((a for a in given if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
