"""Generated block-hash traces (Mooncake format): shared prefix chains of 512-token blocks."""

from __future__ import annotations

import json
import random


def mooncake_lines(requests: int, seed: int = 1, templates: int = 60, instances: int = 1) -> list[str]:
    rng = random.Random(seed)
    chains = [[rng.randrange(10**9) for _ in range(rng.randint(1, 20))] for _ in range(templates)]
    lines = []
    for i in range(requests):
        ids = rng.choice(chains)[: rng.randint(1, 20)] + [
            rng.randrange(10**9) for _ in range(rng.randint(0, 6))
        ]
        line = {
            "timestamp": i * 100,
            "input_length": (len(ids) - 1) * 512 + rng.randint(1, 512),
            "output_length": rng.randint(1, 400),
            "hash_ids": ids,
        }
        if instances > 1:
            line["server_instance"] = i * instances // requests
        lines.append(json.dumps(line))
    return lines


def qwen_lines(conversations: int, seed: int = 1, systems: int = 4, turns: int = 6) -> list[str]:
    """Alibaba/Qwen-style turns at 16-token blocks: a conversation starts from one of a few system prompts,
    each turn carries the whole conversation so far (its hash_ids) plus a new user message; turns of
    different conversations interleave in time (`timestamp` in seconds)."""
    rng = random.Random(seed)
    starts = [[rng.randrange(10**9) for _ in range(rng.randint(8, 40))] for _ in range(systems)]
    events = []
    for c in range(conversations):
        ids, parent, t = list(rng.choice(starts)), -1, rng.uniform(0, conversations)
        for turn in range(1, rng.randint(1, turns) + 1):
            ids += [rng.randrange(10**9) for _ in range(rng.randint(2, 30))]
            chat_id = c * 100 + turn
            line = {
                "chat_id": chat_id,
                "parent_chat_id": parent,
                "turn": turn,
                "timestamp": round(t, 3),
                "input_length": (len(ids) - 1) * 16 + rng.randint(1, 16),
                "output_length": rng.randint(1, 64),
                "hash_ids": list(ids),
            }
            events.append((t, json.dumps(line)))
            ids += [rng.randrange(10**9) for _ in range(rng.randint(1, 4))]  # the answer, in the next turn
            parent, t = chat_id, t + rng.uniform(5, 60)
    return [line for _, line in sorted(events)]


SUPPORT_TEMPLATE = (
    "You are a helpful support agent for an online shop. Answer politely and briefly. Policies: returns "
    "within 30 days with a receipt; shipping is free above 50 euros; refunds take 5 business days; never "
    "share another customer's data. "
) * 3
QUESTIONS = [
    "Where is my order? It was due yesterday.",
    "Can I return shoes that I already wore once?",
    "How long does a refund take?",
    "Do you ship to Norway?",
]


def chat_lines(requests: int, fields: str, seed: int = 1) -> list[dict]:
    """OpenAI chat bodies of a support bot: the shared system prompt with per-request fields in front of
    it (`fields`: "timestamp" = a timestamp and a customer id, "customer" = a customer id only) or after
    the shared part ("last": the layout the fix gives, the same fields at the end of the user message)."""
    rng = random.Random(seed)
    out = []
    for n in range(requests):
        stamp = f"2026-12-03T{10 + n // 3600:02d}:{n // 60 % 60:02d}:{n % 60:02d}Z"
        customer = f"C{rng.randrange(10**6):06d}"
        front = {"timestamp": f"Time: {stamp}. Customer: {customer}. ", "customer": f"Customer: {customer}. "}
        question = rng.choice(QUESTIONS)
        if fields == "last":
            system, user = SUPPORT_TEMPLATE, f"{question} (Time: {stamp}. Customer: {customer}.)"
        else:
            system, user = front[fields] + SUPPORT_TEMPLATE, question
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out.append({"messages": messages, "user": customer, "max_tokens": 32})
    return out


def batch_line(n: int, body: dict, url: str = "/v1/chat/completions") -> dict:
    """An OpenAI Batch API input line."""
    return {"custom_id": f"request-{n}", "method": "POST", "url": url, "body": body}
