"""A model's chat template rendered in Jinja2's sandbox, bounded in time and output (issue 33 item 3d).

The sandbox keeps a template from reaching Python, not from running forever or filling memory: nested
`range` loops ran past 60 s, and string repetition, output loops and join-then-repeat each passed
3 GiB. Here every call, filter, `*`, `+`, `**` and `~` checks the deadline and the size of what it
would build before building it, the rendered output is collected chunk by chunk within its bound,
and (in the main thread) a timer stops a loop that calls nothing. A template that fails, for any
reason, is a ValueError naming the template and its line, never a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0  # a real chat template renders in well under a millisecond
MAX_OUTPUT_CHARS = 1 << 24  # 16M characters: a 1M-token prompt with its template is ~5M


class TemplateBoundError(Exception):
    """The template went past RENDER_SECONDS or MAX_OUTPUT_CHARS."""


class _Codegen(CodeGenerator):
    def visit_Concat(self, node, frame) -> None:  # `a ~ b`: joined within the bound
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _Codegen
    intercepted_binops = frozenset(("*", "+", "**"))

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.deadline = float("inf")
        self.filters = {name: self._bounded_filter(f) for name, f in self.filters.items()}

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(f"rendering took more than {RENDER_SECONDS:g} s")

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # jinja2's signature
        __self.check_time()
        _check_arguments(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator_name: str, left: Any, right: Any) -> Any:
        self.check_time()
        if operator_name == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    _check_length(len(seq) * max(times, 0))
        elif (
            operator_name == "+"
            and isinstance(left, str | list | tuple)
            and isinstance(right, str | list | tuple)
        ):
            _check_length(len(left) + len(right))
        elif operator_name == "**" and isinstance(right, int) and abs(right) > 4096:
            raise TemplateBoundError(f"an exponent of {right}")
        return super().call_binop(context, operator_name, left, right)

    def bounded_join(self, parts) -> str:
        self.check_time()
        parts = [str(p) for p in parts]
        _check_length(sum(map(len, parts)))
        return "".join(parts)

    def _bounded_filter(self, function: Callable) -> Callable:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.check_time()
            _check_arguments(args, kwargs)
            return _check_size(function(*args, **kwargs))

        for attribute in ("jinja_pass_arg",):  # pass_context / pass_environment markers
            if hasattr(function, attribute):
                setattr(bounded, attribute, getattr(function, attribute))
        return bounded


def _check_length(length: int) -> None:
    if length > MAX_OUTPUT_CHARS:
        raise TemplateBoundError(f"a value of {length:,} items, over {MAX_OUTPUT_CHARS:,}")


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """A width or count over the output bound (`center(10**9)`, `'{:>9999999999}'`) is refused first."""
    for value in (*args, *kwargs.values()):
        if type(value) is int and value > MAX_OUTPUT_CHARS:
            _check_length(value)


def _check_size(value: Any) -> Any:
    if isinstance(value, str | list | tuple):
        _check_length(len(value))
    return value


class ChatTemplate:
    """One chat template, compiled once; `render` is bounded and raises ValueError only."""

    def __init__(self, source: str, name: str, globals_: dict[str, Any]) -> None:
        self.name = name
        self.env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        self.env.globals.update(globals_)
        # the name as the code's file name too: a failure's traceback then gives the template's line
        self.env.loader = jinja2.FunctionLoader(lambda _: (source, name, lambda: True))
        try:
            self.template = self.env.get_template(name)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(
                f"the chat template does not compile ({name}, line {err.lineno}): {err}"
            ) from None

    def render(self, **context: Any) -> str:
        self.env.deadline = time.monotonic() + RENDER_SECONDS
        try:
            with _alarm(RENDER_SECONDS + 0.5):
                return self._collect(self.template.generate(**context))
        except Exception as err:  # a template can raise anything: ZeroDivisionError, MemoryError...
            where = f"{self.name}{self._line(err)}"
            raise ValueError(f"the chat template fails on these messages ({where}): {_what(err)}") from None
        finally:
            self.env.deadline = float("inf")

    def _collect(self, chunks: Iterator[str]) -> str:
        out, length = [], 0
        for chunk in chunks:
            length += len(chunk)
            _check_length(length)
            out.append(chunk)
        return "".join(out)

    def _line(self, err: BaseException) -> str:
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == self.name]
        return f", line {lines[-1]}" if lines else ""


def _what(err: BaseException) -> str:
    text = str(err)[:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds`, for a loop that calls nothing (only the main thread can take it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise TemplateBoundError(f"rendering took more than {RENDER_SECONDS:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
