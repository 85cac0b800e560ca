"""When backward finishes each parameter's gradient, from the parameter's name: the stages a
data-parallel sync reads gradients back by while the backward still runs (Lfm2Model.backward's
``on_ready``), and the lowest decoder layer a backward has to reach."""
from __future__ import annotations

import re

from ..runtime import Tensor
from .checkpoint import EMBEDDING, FINAL_NORM


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to, from its name (the model's "model.layers.3.…" or
    PEFT's "base_model.model.model.layers.3.…"), or None."""
    at = re.search(r"\blayers\.(\d+)\.", name)
    return int(at.group(1)) if at else None


def layer_stage(layer: int, n_layers: int) -> int:
    """The stage of layer ``layer``'s gradients: backward finishes the last layer first."""
    return n_layers - layer


def gradient_stages(named: dict[str, Tensor], params, n_layers: int) -> list[list[Tensor]]:
    """``params`` by when backward finishes their gradients: stage 0 the final norm, stage
    ``layer_stage(i)`` layer i, the last stage the rest (the embedding, an untied LM head)."""
    last = n_layers + 1
    stage_of = {}
    for name, t in named.items():
        layer = layer_of(name)
        stage_of[id(t)] = 0 if name == FINAL_NORM else layer_stage(layer, n_layers) if layer is not None else last
    stages: list[list[Tensor]] = [[] for _ in range(last + 1)]
    for p in params:
        stages[stage_of.get(id(p), last)].append(p)
    return stages


def lowest_trained_layer(named: dict[str, Tensor], n_layers: int, trained) -> int | None:
    """The first decoder layer backward must reach: 0 when the embedding is ``trained``, None when
    no layer and not the final norm is (the LM head alone: backward has nothing to do)."""
    if trained(named[EMBEDDING]):
        return 0
    layers = [layer_of(n) for n, t in named.items() if layer_of(n) is not None and trained(t)]
    if layers:
        return min(layers)
    return n_layers if trained(named[FINAL_NORM]) else None
