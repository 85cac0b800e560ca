"""A model directory opened for use on its own (``python -m trainer generate`` and ``eval``): the
cheap checks first (the directory, its tokenizer), then the model and an optional LoRA adapter on
the GPU. Every problem is a one-line UsageError."""
from __future__ import annotations

from pathlib import Path

from .cli.usage import UsageError


def open_tokenizer(model: str, tokenizer: str | None = None):
    """(the model directory, its tokenizer, or ``tokenizer``'s), before any GPU work."""
    from .data import load_tokenizer
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: not a model directory (no config.json)")
    try:
        return model_dir, load_tokenizer(tokenizer or model_dir)
    except (ValueError, FileNotFoundError) as e:
        if tokenizer:
            raise UsageError(f"--tokenizer {tokenizer}: {e}") from None
        raise UsageError(f"tokenizer: {e} (give --tokenizer PATH)") from None


def load_model(model_dir: Path, tok, adapter: str | None = None, gpu: str | None = None, f16: bool = False):
    """The model (with ``adapter`` applied) on the adapter whose name contains ``gpu`` (the best one
    by default), with f16 activations when ``f16``."""
    from lfm2jit import ComputeEngine, WgpuContext
    from lfm2jit.model import CheckpointError, ConfigError, Lfm2Model
    from lfm2jit.model.lora import AdapterError
    from lfm2jit.runtime.context import AdapterError as GpuError
    try:
        ctx = WgpuContext.create(gpu or None)
    except GpuError as e:
        raise UsageError(str(e)) from None
    if f16 and not ctx.has_f16:     # refused, not run in f32: --f16 asks for half the activation memory
        raise UsageError(f"--f16 (f16 activations): adapter {ctx.name!r} lacks the shader-f16 feature; "
                         "run without --f16")
    try:
        model = Lfm2Model.from_pretrained(model_dir, ctx, ComputeEngine(ctx), "f16" if f16 else "f32")
        if adapter:
            model.load_adapter(adapter)
    except (CheckpointError, ConfigError, AdapterError, ValueError) as e:
        raise UsageError(f"--model {model_dir}{' --adapter ' + adapter if adapter else ''}: {e}") from None
    ids = tok.get_vocab_size(with_added_tokens=True)
    if ids > model.cfg.vocab_size:
        raise UsageError(f"the tokenizer has {ids} ids but the model's vocab_size is {model.cfg.vocab_size}")
    return model
