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
