"""The one value type derivations return and exposition renders: neutral ground for both."""

from __future__ import annotations

from typing import NamedTuple


class Sample(NamedTuple):
    """One exported value: a catalog metric name, its labels and the value."""

    name: str
    labels: dict[str, str]
    value: float


# A label value that comes from the data (a session id, an adapter or tier name, a model name) is
# cut to this many characters (the KV-event decoder's bound on names, so a name it accepts is never
# cut) and its control characters (NUL, ESC, ...) replaced: legal in the text format, hostile to
# many of its consumers.
MAX_LABEL_CHARS = 256
REPLACEMENT = "\ufffd"


def label_value(value: str) -> str:
    """`value` safe to export: printable, at most MAX_LABEL_CHARS characters."""
    if len(value) <= MAX_LABEL_CHARS and value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else REPLACEMENT for ch in value[:MAX_LABEL_CHARS])
