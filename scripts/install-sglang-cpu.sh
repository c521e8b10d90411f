#!/usr/bin/env bash
# Install a real SGLang 0.5.23 server for these CPUs into a cached venv (default ~/.cache/kvcache-exporter/
# sglang-cpu-venv: 2.3 GB, kept between test sessions like .venv-vllm), the lean set that ran here:
#   1. torch 2.13.0+cpu from VLLM_TORCH_SOURCE (the same source as the vLLM recipe: a wheel folder, a .whl
#      file or an index URL), never the CUDA build pip would resolve for sglang's pins;
#   2. scripts/sglang-cpu/requirements.txt with --no-deps (a freeze of the venv that ran; no torchvision,
#      torchaudio or CUDA libraries);
#   3. import-only stand-ins: ../shared/tools/sglang-cpu/shim (sgl_kernel, which has no CPU wheel, plus its
#      scalar_type.py taken from the sglang-kernel wheel) and scripts/sglang-cpu/stub_torchvision.py
#      (torchvision/torchaudio, imported at start-up for multimodal models the tiny Llama never loads).
# Idempotent: a stamp records the sha256 of the list and the stub; a match does nothing.
#   SGLANG_VENV   venv path; SGLANG_SHIM_SOURCE  the shim folder (default ../shared/tools/sglang-cpu/shim)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcache-exporter/sglang-cpu-venv}"
REQS=scripts/sglang-cpu/requirements.txt
STUB=scripts/sglang-cpu/stub_torchvision.py
SHIM="${SGLANG_SHIM_SOURCE:-../shared/tools/sglang-cpu/shim}"
TORCH_SOURCE="${VLLM_TORCH_SOURCE:-${PIP_FIND_LINKS:-/opt/wheels}}"
KERNEL=sglang-kernel==0.4.10
log() { printf 'install-sglang-cpu: %s\n' "$*" >&2; }

want="$(cat "$REQS" "$STUB" | sha256sum | cut -c1-16)"
if [[ -f "$VENV/.kvcache-sglang-installed" && "$(cat "$VENV/.kvcache-sglang-installed")" == "$want" ]]; then
  log "already installed in $VENV"
  exit 0
fi
[[ -d "$SHIM/sgl_kernel" ]] || { log "no sgl_kernel shim at $SHIM: set SGLANG_SHIM_SOURCE"; exit 1; }
case "$TORCH_SOURCE" in
  http://* | https://*) torch_args=(--index-url "$TORCH_SOURCE" torch==2.13.0+cpu) ;;
  *.whl) torch_args=("$TORCH_SOURCE") ;;
  *) torch_args=(--find-links "$TORCH_SOURCE" torch==2.13.0+cpu) ;;
esac
UV="$ROOT/.venv/bin/uv"
[[ -x "$UV" ]] || UV="$(command -v uv)" || { log "uv not found: run make venv first"; exit 1; }
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$UV" venv --quiet --python 3.11 "$VENV"
"$UV" pip install --quiet --python "$VENV/bin/python" --no-deps "${torch_args[@]}"
"$UV" pip install --quiet --python "$VENV/bin/python" --no-deps -r "$REQS"
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
cp "$STUB" "$site/" && echo "import stub_torchvision" >"$site/kvcache_test_stubs.pth"
mkdir -p "$VENV/shim" && cp -r "$SHIM/." "$VENV/shim/"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps -d "$tmp" "$KERNEL"
"$VENV/bin/python" - "$tmp" "$VENV/shim/sgl_kernel" <<'PY'
import glob, sys, zipfile
with zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith("sgl_kernel/scalar_type.py"))
    open(sys.argv[2] + "/scalar_type.py", "wb").write(wheel.read(name))
PY
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$VENV/shim" "$VENV/bin/python" -c 'import sglang.launch_server' 2>/dev/null \
  || { log "sglang does not import in $VENV"; exit 1; }
echo "$want" >"$VENV/.kvcache-sglang-installed"
log "installed in $VENV in $(($(date +%s) - start)) s"
