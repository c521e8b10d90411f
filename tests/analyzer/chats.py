"""A chat log as a new user's app sends it (the newcomer's case of issue 29): OpenAI chat bodies, a
per-request timestamp first in the system message, then the app's instructions, earlier turns and the
new question. Deterministic text, rendered by the analyzer with the tiny Llama's tokenizer."""

from __future__ import annotations

import json
import random

WORDS = (
    "order",
    "refund",
    "parcel",
    "courier",
    "invoice",
    "account",
    "warranty",
    "return",
    "label",
    "address",
    "payment",
    "card",
    "discount",
    "voucher",
    "size",
    "colour",
    "stock",
    "delivery",
    "tracking",
    "number",
    "store",
    "branch",
    "weekend",
    "holiday",
    "support",
    "agent",
)
INSTRUCTIONS = (
    "You are the customer service assistant of a large online shop. Answer politely and briefly. "
    "Never promise refunds above the order value. Ask for the order number when it is missing. "
    "Escalate to a human agent when the customer is angry or mentions a lawyer. "
    + " ".join(f"Rule {n}: check the {WORDS[n]} before the {WORDS[n + 5]}." for n in range(len(WORDS) - 5))
)


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def timestamp_first_chat(
    requests: int = 120, sessions: int = 12, turns: int = 5, seed: int = 29, where: str = "first"
) -> list:
    """Trace lines: every request's system message starts with the time it was sent (`where` "first"),
    or the same requests with it fixed: at the end of the system message, after the shared instructions
    ("after_template"), or after the new question, at the very end ("end")."""
    rng = random.Random(seed)
    questions = [_sentence(rng, 8, 20) + " " + _sentence(rng, 4, 10) for _ in range(24)]
    history: dict[int, list[dict]] = {}
    out = []
    for i in range(requests):
        session = rng.randrange(sessions)
        turns_so_far = history.setdefault(session, [])
        seconds = 9 * 3600 + 157 * i  # a request every 2-3 minutes over a working day
        stamp = f"2026-12-04T{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"
        now = f"Current time: {stamp}."
        system = {"role": "system", "content": f"{now} {INSTRUCTIONS}" if where == "first" else INSTRUCTIONS}
        if where == "after_template":
            system["content"] += f" {now}"
        question = {"role": "user", "content": rng.choice(questions)}
        sent = {**question, "content": f"{question['content']} {now}"} if where == "end" else question
        messages = [system, *turns_so_far, sent]
        out.append(json.dumps({"i": i, "session": f"chat-{session}", "messages": messages, "max_tokens": 16}))
        answer = {"role": "assistant", "content": _sentence(rng, 10, 30)}
        history[session] = [*turns_so_far, question, answer] if len(turns_so_far) < 2 * turns else []
    return out
