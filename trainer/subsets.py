"""Which parameters a run trains: all of them, LoRA adapters, or the ones shell patterns name
(``--train-only`` / ``--freeze``), resolved once against the model's parameter names."""
from __future__ import annotations

from fnmatch import fnmatchcase

from .cli.usage import UsageError


def _matching(names, patterns: list[str], flag: str) -> set[str]:
    out = set()
    for pat in patterns:
        hits = {n for n in names if fnmatchcase(n, pat)}
        if not hits:
            sample = ", ".join(list(names)[:3])
            raise UsageError(f"{flag} {pat!r} matches no parameter (names look like {sample}, ...)")
        out |= hits
    return out


def trainable(model, lora: bool, train_only: list[str] | None, freeze: list[str] | None) -> list:
    """The parameters to train, in the model's order. With LoRA: the adapters, plus what
    ``train_only`` names; without: what ``train_only`` names (default everything). ``freeze``
    then removes its matches. An empty result is an error, not a run that trains nothing."""
    named = model.named_parameters()
    chosen = set(model.lora.named) if lora else (set() if train_only else set(named))
    if train_only:
        chosen |= _matching(named, train_only, "--train-only")
    if freeze:
        chosen -= _matching(named, freeze, "--freeze")
    if not chosen:
        raise UsageError("--train-only and --freeze leave no parameter to train")
    halves = sorted(n for n in chosen if named[n].dtype == "f16")
    if halves:
        raise UsageError(f"--lora-f16-base keeps {halves[0]} as a frozen f16 weight; it cannot also be trained "
                         "(drop it from --train-only, or the --lora-f16-base flag)")
    return [t for n, t in named.items() if n in chosen]
