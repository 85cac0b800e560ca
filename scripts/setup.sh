#!/usr/bin/env bash
# Idempotent setup for a fresh Debian machine (or a dev box): .venv with lfm2jit and its test
# dependencies, and a wgpu adapter - Mesa's lavapipe (Vulkan on the CPU) when there is no GPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

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

# Reinstall only when pyproject.toml changed since the last successful install (-I: not from the cwd).
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! "$VENV_PY" -I -c "import lfm2jit" 2>/dev/null; then
    log "pip install -e .[test] (quiet; a first install takes a few minutes)"
    # Drop pip's per-package notes about configured local index folders that do not exist.
    "$VENV_PY" -m pip install -q -e ".[test]" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
    echo "$want" > "$STAMP"
fi

adapters() {
    "$VENV_PY" -c 'import wgpu; print("; ".join(a.summary for a in wgpu.gpu.enumerate_adapters_sync()))' 2>/dev/null
}

found="$(adapters || true)"
if [ -z "$found" ]; then
    log "wgpu found no adapter; installing Mesa's Vulkan drivers (lavapipe runs Vulkan on the CPU)"
    apt_install mesa-vulkan-drivers libvulkan1
    found="$(adapters || true)"
fi
if [ -z "$found" ]; then
    log "ERROR: wgpu still finds no adapter after installing mesa-vulkan-drivers and libvulkan1."
    log "Check 'vulkaninfo --summary' (package vulkan-tools) or install your GPU's Vulkan driver."
    exit 1
fi
log "ready; wgpu adapters: $found"
