"""The kernels that ship with lfm2jit: every ``ops/kernels/*.lk`` file in the package, by kernel name
(registered with the driver, so ``engine.run`` takes their names)."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from ..driver import Kernel, compile_source, name_kernels_with
from ..safefiles import CheckedFiles
from ..settings import settings


def sources() -> dict[str, str]:
    """File name -> text of each shipped kernel source."""
    root = resources.files("lfm2jit.ops").joinpath("kernels")
    return {p.name: p.read_text() for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".lk")}


@lru_cache(maxsize=1)
def kernels() -> dict[str, Kernel]:
    out: dict[str, Kernel] = {}
    root = settings().cache_dir          # their syntax trees kept there between processes, if it is ours
    cache = CheckedFiles.inside(root, "ast") if root is not None else None
    for fname, text in sources().items():
        for k in compile_source(text, f"lfm2jit/ops/kernels/{fname}", cache):
            if k.name in out:
                raise RuntimeError(f"kernel {k.name!r} is defined in two shipped files")
            out[k.name] = k
    return out


def get(name: str) -> Kernel:
    ks = kernels()
    if name not in ks:
        raise KeyError(f"no shipped kernel named {name!r}; available: {', '.join(sorted(ks))}")
    return ks[name]


name_kernels_with(get)
