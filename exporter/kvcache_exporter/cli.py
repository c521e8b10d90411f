"""`kvcache-exporter`: the only place that parses arguments and exits the process."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from . import __version__, config, docs
from .config import OPTIONS, ConfigError

DESCRIPTION = """Prometheus exporter for vLLM's KV (prefix) cache: run `serve` beside vLLM and scrape it.
The other commands are tools around it. `kvcache-exporter COMMAND --help` lists a command's flags."""
EXAMPLE = "example: kvcache-exporter serve --vllm.url http://127.0.0.1:8000/metrics"


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="poll vLLM (and the GPU, and the KV-event stream) and serve the derived metrics",
        description="Every flag has an environment twin (KVCACHE_EXPORTER_<FLAG>) and a --config.file key.",
    )
    serve.add_argument(
        "--config.file", dest="config_file", help="optional YAML file with the same keys as the flags"
    )
    serve.add_argument(
        "--check-config", action="store_true", help="validate the configuration and exit (0 or 1)"
    )
    for option in OPTIONS:
        serve.add_argument(
            option.flag,
            dest=option.attr,
            action="append" if option.multiple else "store",
            metavar=option.key.rsplit(".", 1)[-1].upper(),
            help=f"{option.help} (env {option.env}; default {config.default_text(option)})",
        )
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .server import serve
    from .web.config import load_web_config

    flags = {o.key: getattr(args, o.attr) for o in OPTIONS}
    try:
        # One check for --check-config and start-up alike: serve() loads the web config again itself.
        settings = config.resolve(flags, dict(os.environ), args.config_file)
        load_web_config(settings.web_config_file)
        if args.check_config:
            print("configuration OK")
            return 0
        return asyncio.run(serve(settings))
    except ConfigError as err:  # also what only start-up can find, e.g. the port is taken
        print(f"kvcache-exporter: {err}", file=sys.stderr)
        return 1


def _docs(args: argparse.Namespace) -> int:
    text = docs.metrics_markdown()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


SIDECAR_COMMANDS = ("serve", "docs")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All subcommands; for `serve` and `docs` only those, so the sidecar never imports the tools
    (simulator, analyzer, demo, aggregate, mixin): tests/core/test_layering.py holds this."""
    parser = argparse.ArgumentParser(prog="kvcache-exporter", description=DESCRIPTION, epilog=EXAMPLE)
    parser.add_argument("--version", action="version", version=f"kvcache-exporter {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(subparsers)
    # For maintainers (`make generate`): no help= keeps it out of the list users read.
    doc = subparsers.add_parser("docs", description="write docs/metrics.md from the metric catalog")
    doc.add_argument("--output", default="-", help="file to write (default stdout)")
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
