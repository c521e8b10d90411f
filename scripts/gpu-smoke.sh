#!/usr/bin/env bash
# Read the GPUs once through the exporter's NVML source and print the snapshot as JSON.
# Needs only python3 and this repository; installs nvidia-ml-py and the package into a scratch dir.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
scratch="${GPU_SMOKE_DIR:-$(mktemp -d)}"
python3 -m pip install --quiet --disable-pip-version-check --target "$scratch" \
  "nvidia-ml-py>=12" "prometheus-client>=0.20" "aiohttp>=3.9"
export PYTHONPATH="$repo/exporter:$scratch"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total,power.draw --format=csv
python3 -m kvcache_exporter.sources.nvml "$@"
