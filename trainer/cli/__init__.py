"""The command-line app, ``python -m trainer [COMMAND]``: one module per command. Without a command
it trains (trainer/cli/train.py); ``dpo`` trains on preference pairs (trainer/cli/dpo.py) and ``grpo``
with reward functions (trainer/cli/grpo.py), with the train command's machinery; ``generate`` and ``eval`` use a trained model alone;
``export-gguf`` writes one as a GGUF file for llama.cpp (trainer/cli/export_gguf.py)."""
from __future__ import annotations

import importlib
import sys

from lfm2jit.settings import SettingsError, settings

# command word -> its module in this package; anything else is the train command's flags
COMMANDS = {"generate": "generate", "eval": "eval", "dpo": "dpo", "grpo": "grpo", "export-gguf": "export_gguf"}


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (``sys.argv[1:]`` by default); its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        settings()              # the LFM2JIT_ environment, checked before any flag, file or device
    except SettingsError as e:
        print(f"python -m trainer: error: {e}", file=sys.stderr)
        return 2
    if argv[:1] and argv[0] in COMMANDS:
        return importlib.import_module(f".{COMMANDS[argv[0]]}", __name__).main(argv[1:])
    return importlib.import_module(".train", __name__).main(argv)
