"""What every fuzz test shares: how many cases it runs (FUZZ_EXAMPLES; `make fuzz` sets 100,000),
replayed the same way in CI and explored by `make fuzz`."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz_settings(default: int, share: int = 1) -> settings:
    """`default` cases unless FUZZ_EXAMPLES says otherwise; `share`: run 1/share of them (each case
    is costly, e.g. a real HTTP exchange). Derandomized below 10,000 so a CI run is reproducible."""
    total = int(os.environ.get("FUZZ_EXAMPLES", str(default)))
    return settings(
        max_examples=total if share == 1 else max(total // share, 50),
        deadline=None,
        derandomize=total < 10_000,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
