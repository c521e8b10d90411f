"""prometheus-operator's CRD schemas, offline: cloudcoil's pydantic models generated from the CRDs.

The models (like npm's @kubernetes-models/prometheus-operator) accept an unknown field and drop
it, so a typo such as `intervall` would pass; errors() also reports every field the model did not
keep, which is what the API server's structural schema (pruning) would silently discard.
"""

from __future__ import annotations

from collections.abc import Iterator

import pydantic
from cloudcoil.models.prometheus_operator import v1

MODELS = {
    "ServiceMonitor": v1.ServiceMonitor,
    "PodMonitor": v1.PodMonitor,
    "PrometheusRule": v1.PrometheusRule,
}


def errors(obj: dict) -> list[str]:
    try:
        model = MODELS[obj["kind"]].model_validate(obj)
    except pydantic.ValidationError as err:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    kept = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return [f"{path}: unknown field" for path in _dropped(obj, kept)]


def _dropped(given, kept, path: str = "") -> Iterator[str]:
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(kept, dict) or key not in kept:
                yield path + key
            else:
                yield from _dropped(value, kept[key], f"{path}{key}.")
    elif isinstance(given, list):
        for i, (a, b) in enumerate(zip(given, kept, strict=False)):
            yield from _dropped(a, b, f"{path}{i}.")
