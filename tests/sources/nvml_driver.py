"""Runs the NVML source in a fresh process (pynvml loads libnvidia-ml.so.1 once per process).

argv: "auto" to report which source make_gpu_source("auto") picks, else one NVML state file per
collection (each becomes $FAKE_NVML_STATE before that collection). Prints a JSON list.
"""

import asyncio
import dataclasses
import json
import os
import sys

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.gpu_factory import make_gpu_source
from kvcache_exporter.sources.nvml import NvmlSource


def main() -> None:
    if sys.argv[1] == "auto":
        try:
            picked = type(make_gpu_source("auto")).__name__
        except SourceError as off:
            picked = off.reason
        print(json.dumps([picked]))
        return
    devices = [d for d in os.environ.get("NVML_DEVICES", "").split(",") if d]
    source = NvmlSource(devices=devices, max_processes=int(os.environ.get("NVML_MAX_PROCESSES", "8")))
    results = []
    for state in sys.argv[1:]:
        os.environ["FAKE_NVML_STATE"] = state
        try:
            results.append({"snapshot": dataclasses.asdict(asyncio.run(source.collect()))})
        except SourceError as error:
            results.append({"error": error.reason, "type": type(error).__name__})
    source.release()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
