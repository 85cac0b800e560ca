# Sourced by the scripts here: run from the repository root, with a valid XDG_RUNTIME_DIR
# (Mesa's lavapipe prints "XDG_RUNTIME_DIR is invalid" on every device it opens without one).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "$XDG_RUNTIME_DIR" ]; then
    export XDG_RUNTIME_DIR="${TMPDIR:-/tmp}/lfm2jit-runtime-$(id -u)"
    mkdir -p "$XDG_RUNTIME_DIR"
    chmod 700 "$XDG_RUNTIME_DIR"
fi
