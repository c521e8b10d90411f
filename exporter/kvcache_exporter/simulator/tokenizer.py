"""A deterministic toy tokenizer: one token per whitespace-separated word (punctuation split off).

Token id = 5 + (first 4 bytes of sha256(word) mod 495), so equal text always gives equal ids (which is
all prefix caching needs) and ids stay in the seed model's 5-500 range. `decode` cannot invert ids,
so generated text is rendered as `tok<id>` words.
"""

from __future__ import annotations

import hashlib
import re

_WORD = re.compile(r"\w+|[^\w\s]")


def encode(text: str) -> list[int]:
    return [
        5 + int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "big") % 495 for w in _WORD.findall(text)
    ]


def decode(token_ids: list[int]) -> str:
    return " ".join(f"tok{t}" for t in token_ids)


def encode_chat(messages: list[dict]) -> list[int]:
    """A minimal chat template: `<|role|> content` per message, then the assistant cue."""
    parts = [f"<|{m.get('role', 'user')}|> {_content_text(m.get('content', ''))}" for m in messages]
    return encode(" ".join([*parts, "<|assistant|>"]))


def _content_text(content: object) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)
