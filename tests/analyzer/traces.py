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
