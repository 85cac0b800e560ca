#!/usr/bin/env bash
# Idempotent setup for a fresh Debian machine (or a dev box):
#   bash scripts/setup.sh          .venv with lfm2jit and its runtime dependencies (the main job's)
#   bash scripts/setup.sh test     ... and the test references (pytest, torch, transformers, peft, trl)
# and a Vulkan, Metal or D3D12 adapter: Mesa's lavapipe (Vulkan on the CPU) is installed when wgpu
# finds none (an OpenGL-only adapter such as Mesa's GL llvmpipe does not count: no shader-f16, and
# not what CI tests). `setup.sh --print-install [test]` prints the pip target and exits.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

MODE="${1:-main}"
if [ "$MODE" = "--print-install" ]; then MODE="${2:-main}"; PRINT_ONLY=1; else PRINT_ONLY=0; fi
case "$MODE" in
    main) TARGET="."; EXTRAS=main ;;
    test) TARGET=".[test]"; EXTRAS=test ;;
    *) echo "usage: bash scripts/setup.sh [main|test] | --print-install [main|test]" >&2; exit 2 ;;
esac
if [ "$PRINT_ONLY" = 1 ]; then echo "pip install -e $TARGET"; exit 0; fi

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV_PY=.venv/bin/python
STAMP=.venv/.lfm2jit-installed

log() { echo "setup: $*" >&2; }

# Run apt-get as root, through sudo when we are not root; fail clearly when neither is possible.
apt_install() {
    local run=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { log "need root or sudo to apt-get install $*"; exit 1; }
        run=(sudo)
    fi
    log "apt-get install $*"
    "${run[@]}" apt-get update -qq
    "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

make_venv() {
    rm -rf .venv
    "$PYTHON" -m venv .venv
}

if ! "$VENV_PY" -m pip --version >/dev/null 2>&1; then
    log "creating .venv with $PYTHON"
    if ! make_venv 2>/dev/null; then
        # Debian ships the venv module separately.
        apt_install "python3.$("$PYTHON" -c 'import sys; print(sys.version_info[1])')-venv"
        make_venv
    fi
fi

# Reinstall only when pyproject.toml changed since the last successful install, or the test extras
# are wanted and only the runtime was installed (-I: not from the cwd). The stamp: "<hash> <extras>".
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
read -r have_hash have_extras 2>/dev/null < "$STAMP" || { have_hash=""; have_extras=""; }
if [ "$have_hash" != "$want" ] || { [ "$EXTRAS" = test ] && [ "$have_extras" != test ]; } \
        || ! "$VENV_PY" -I -c "import lfm2jit" 2>/dev/null; then
    log "pip install -e $TARGET (quiet; a first install takes a few minutes)"
    # Drop pip's per-package notes about configured local index folders that do not exist.
    "$VENV_PY" -m pip install -q -e "$TARGET" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
    if [ "$have_hash" = "$want" ] && [ "$have_extras" = test ]; then EXTRAS=test; fi
    echo "$want $EXTRAS" > "$STAMP"
fi

adapters() {   # the Vulkan, Metal and D3D12 adapters wgpu lists (lfm2jit.runtime.context.native_adapters)
    "$VENV_PY" -c 'import wgpu; from lfm2jit.runtime.context import native_adapters
print("; ".join(a.summary for a in native_adapters(wgpu.gpu.enumerate_adapters_sync())))' 2>/dev/null
}

found="$(adapters || true)"
if [ -z "$found" ]; then
    log "wgpu found no Vulkan/Metal/D3D12 adapter; installing Mesa's Vulkan drivers (lavapipe runs Vulkan on the CPU)"
    apt_install mesa-vulkan-drivers libvulkan1
    found="$(adapters || true)"
fi
if [ -z "$found" ]; then
    log "ERROR: wgpu still finds no Vulkan adapter after installing mesa-vulkan-drivers and libvulkan1."
    log "Check 'vulkaninfo --summary' (package vulkan-tools) or install your GPU's Vulkan driver."
    exit 1
fi
log "ready; wgpu adapters: $found"
