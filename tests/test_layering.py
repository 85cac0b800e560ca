"""The compiler's data flows one way, and its imports say so: dsl -> ir -> schedule -> codegen ->
driver, the runtime below all of them importing none, the engine joining driver and runtime (and
nothing above them: not ops), and nothing in lfm2jit importing the trainer. tune is two layers: its
tile classes and default-tile heuristics (tune.tiles, tune.heuristics) sit below schedule, whose
planners ask them for tiles; the autotuner (the rest of tune) sits above schedule, whose specs it
times. Read from the source (every import statement, at any depth), so a lazy import inside a
function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lfm2jit"

# Modules that are a layer of their own, apart from the rest of their subpackage.
OWN_LAYERS = {"tune.tiles", "tune.heuristics"}
TILES = {"tune.tiles", "tune.heuristics"}

# What each part of the package may import from lfm2jit (itself always allowed).
ALLOWED = {
    "dsl": set(),
    "ir": {"dsl"},
    "tune.tiles": set(),
    "tune.heuristics": {"tune.tiles"},
    "schedule": {"dsl", "ir"} | TILES,
    "codegen": {"dsl", "ir", "schedule"} | TILES,
    "driver": {"dsl", "ir", "schedule", "codegen", "safefiles"} | TILES,
    "settings": set(),
    "safefiles": set(),
    "runtime": {"settings", "safefiles"},
    "tune": {"schedule", "settings", "ir", "dsl", "safefiles"} | TILES,
    "engine": {"driver", "dsl", "ir", "schedule", "codegen", "runtime", "settings", "tune", "safefiles"} | TILES,
}


def _part(module: str) -> str:
    """lfm2jit.ir.check -> ir; lfm2jit.driver -> driver; lfm2jit.tune.heuristics -> tune.heuristics."""
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    return ".".join(parts[1:3]) if ".".join(parts[1:3]) in OWN_LAYERS else parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    """Whether lfm2jit.x.y names a module or package (``from lfm2jit.x import y`` imports it)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """The absolute lfm2jit modules a file imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {a.name for a in node.names if _is_module(f"{target}.{a.name}")}
            if len(submodules) < len(node.names):      # names defined by the module itself
                found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m == "trainer" or m.startswith(("lfm2jit", "trainer."))}


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_imports_follow_the_data_flow(path):
    own = _part(_module_name(path))
    bad = []
    for target in imports_of(path):
        if target.split(".")[0] == "trainer":
            bad.append(target)
            continue
        other = _part(target)
        if own in ALLOWED and other and other != own and other not in ALLOWED[own] and \
                other.split(".")[0] in {p.stem for p in PACKAGE.iterdir()}:
            bad.append(target)
    assert not bad, f"{path.relative_to(PACKAGE)} ({own or 'lfm2jit'}) imports {sorted(bad)}"


def test_the_subpackages_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for path in FILES:
        own = _part(_module_name(path))
        if own:
            graph.setdefault(own, set()).update(
                p for t in imports_of(path) if (p := _part(t)) and p != own and t.startswith("lfm2jit"))
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, f"import cycle: {' -> '.join(trail + [node])}"
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [node])
        state[node] = 2
    for node in sorted(graph):
        visit(node, [])
