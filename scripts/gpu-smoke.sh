#!/usr/bin/env bash
# Read the GPUs once through the exporter's NVML source and print the snapshot as JSON.
# Needs python3 and this repository. nvidia-ml-py (one file, pynvml.py) comes from, in order: the
# current python3, `pip install --target` into a scratch dir, or the repository's .venv.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
scratch="${GPU_SMOKE_DIR:-$(mktemp -d)}"
export PYTHONPATH="$repo/exporter:$scratch"
if ! python3 -c "import pynvml" 2>/dev/null; then
  if ! timeout 60 python3 -m pip install --quiet --disable-pip-version-check --target "$scratch" \
    "nvidia-ml-py>=12" 2>/dev/null; then
    vendored=$(ls "$repo"/.venv/lib/python3*/site-packages/pynvml.py 2>/dev/null | head -1)
    [ -n "$vendored" ] || { echo "no nvidia-ml-py: pip failed and no .venv copy" >&2; exit 2; }
    cp "$vendored" "$scratch/"
  fi
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,memory.used,memory.total,power.draw --format=csv
fi
python3 -m kvcache_exporter.sources.nvml "$@"
