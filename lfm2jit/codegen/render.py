"""KernelSpec -> WGSL through the Jinja templates (StrictUndefined: a missing parameter is an error).

A template sees the spec's common fields (kernel, template, dims, scalars, bindings) and its
typed parameters' fields by name; typed values (the spec's index expressions and values, and the
offsets codegen/offsets.py builds) are spelled with the ``wgsl`` filter, tensor bindings named with
``buf``, or (where a tensor may be bound in pieces) reached with ``load`` and ``store``.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from importlib import resources
from pathlib import Path

import jinja2

from ..schedule.spec import KernelSpec
from . import offsets, wgsl


def templates_dir() -> Path:
    """templates/ at the top of a checkout (editable install), else lfm2jit/templates in a wheel."""
    checkout = Path(__file__).resolve().parents[2] / "templates"
    if checkout.is_dir() and (checkout / "pointwise.wgsl.j2").exists():
        return checkout
    return Path(str(resources.files("lfm2jit") / "templates"))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=False, lstrip_blocks=False, autoescape=False)
    env.filters.update(wgsl=wgsl.spell, buf=wgsl.buffer, load=wgsl.load, store=wgsl.store, element=wgsl.element, element_bytes=wgsl.element_bytes, const=wgsl.const_name,
                       f32=lambda v: wgsl.literal(v, "f32"))
    env.globals.update(reduce_init=wgsl.reduce_init, reduce_combine=wgsl.reduce_combine,
                       tile_at=offsets.tile_at, operand_at=offsets.operand_at, fragment_at=offsets.fragment_at,
                       ws_at=offsets.ws_at, c_at=offsets.c_at)
    return env


def render(spec: KernelSpec) -> str:
    params = {f.name: getattr(spec.params, f.name) for f in dataclasses.fields(spec.params)}
    for cls in reversed(type(spec.params).__mro__):           # properties of the class and its bases
        params.update((name, getattr(spec.params, name)) for name, attr in vars(cls).items()
                      if isinstance(attr, property))
    with wgsl.pieced(b.tensor for b in spec.bindings if b.pieces > 1):
        return environment().get_template(f"{spec.template}.wgsl.j2").render(
            kernel=spec.kernel, template=spec.template, dims=spec.dims, scalars=spec.scalars,
            bindings=spec.bindings, uses_f16=any(b.dtype == "f16" for b in spec.bindings),
            entry_points=[e.name for e in spec.entry_points], p=spec.params, **params)
