"""KernelSpec -> WGSL text through the Jinja templates (StrictUndefined: a missing parameter is an error)."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import jinja2

from ..schedule import KernelSpec


def templates_dir() -> Path:
    """templates/ at the top of a checkout (editable install), else lfm2jit/templates in a wheel."""
    checkout = Path(__file__).resolve().parents[2] / "templates"
    if checkout.is_dir() and (checkout / "pointwise.wgsl.j2").exists():
        return checkout
    return Path(str(resources.files("lfm2jit") / "templates"))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=False, lstrip_blocks=False, autoescape=False)


def render(spec: KernelSpec) -> str:
    return environment().get_template(f"{spec.template}.wgsl.j2").render(**spec.context)
