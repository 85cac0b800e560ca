"""A greedy delta-debugging shrinker over the fuzzer's expression tree.

Each step tries smaller variants of a failing case (drop a statement or an output, replace a
subexpression by one of its children or by a leaf, inline a temporary, drop an unused parameter,
drop a default or an optional mark, call it more simply (no padding poison, a left-out input
passed, an optional axis passed), make an axis smaller, use the smaller bucket) and keeps the
first that still fails the same way (same side, same class and, for exceptions, the same
normalised message). Variants that the
fuzzer's own type rules reject are never run.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

from .expr import (INTS, SEQ, Checker, Expr, Fn, KernelDef, ModelError, Num, Param, Ref, children, walk,
                   with_children)
from .generate import Case
from .run import Result, Runner


def same_failure(side: str, cls: str, cause: str) -> Callable[[Result], bool]:
    """Same side, class and cause (for wrong: numbers, non-finite numbers or a shape); a backward
    failure must keep a forward that does not fail (a variant whose forward is wrong has drifted
    out of what the original showed, e.g. pow of a negative base once a safety wrapper is gone)."""
    def pred(r: Result) -> bool:
        o = r.forward if side == "forward" else r.backward
        if side == "backward" and r.forward.failing:
            return False
        return o.cls == cls and o.cause() == cause
    return pred


def failure_of(r: Result) -> tuple[str, str, str] | None:
    for side, o in (("forward", r.forward), ("backward", r.backward)):
        if o.failing:
            return side, o.cls, o.cause()
    return None


def _paths(e: Expr, prefix=()):
    yield prefix, e
    for i, c in enumerate(children(e)):
        yield from _paths(c, prefix + (i,))


def _replace(e: Expr, path, new: Expr) -> Expr:
    if not path:
        return new
    kids = list(children(e))
    kids[path[0]] = _replace(kids[path[0]], path[1:], new)
    return with_children(e, tuple(kids))


def _clone(case: Case, kernel: KernelDef | None = None, sizes=None, bucket=None, **calls) -> Case:
    """A copy (calls: left_out=, dropped=, poison= to change how it is called); left-out inputs and
    dropped axes the kernel no longer has are forgotten."""
    k = kernel if kernel is not None else copy.deepcopy(case.kernel)
    left_out = calls.get("left_out", case.left_out)
    dropped = calls.get("dropped", case.dropped)
    defaulted = {p.name for p in k.inputs if p.default is not None}
    axes = set(k.axes())
    return Case(k, dict(sizes if sizes is not None else case.sizes), bucket or case.bucket, case.seed,
                case.data_seed, case.note, dict(case.meta),
                left_out=tuple(n for n in left_out if n in defaulted),
                dropped=tuple(a for a in dropped if a in axes),
                poison=calls.get("poison", case.poison))


def _well_typed(k: KernelDef) -> bool:
    try:
        Checker(k).check()
        return True
    except (ModelError, KeyError):
        return False


def prune(k: KernelDef) -> KernelDef:
    """Drop inputs nobody reads (in-place parameters stay)."""
    used = {n.name for _, e in k.body for n in walk(e) if isinstance(n, Ref)}
    keep = [p for p in k.inputs if p.name in used or p.name in k.inplace]
    return KernelDef(k.name, keep, list(k.outputs), list(k.body))


def variants(case: Case):
    k = case.kernel
    outs = {o.name for o in k.outputs}
    # 1. drop a statement (a temporary, or an output with its declaration)
    for i, (t, _) in enumerate(k.body):
        body = k.body[:i] + k.body[i + 1:]
        if t in outs:
            if len(k.outputs) == 1:
                continue
            yield KernelDef(k.name, list(k.inputs), [o for o in k.outputs if o.name != t], body)
        else:
            yield KernelDef(k.name, list(k.inputs), list(k.outputs), body)
    # 2. inline a temporary into its uses
    for i, (t, e) in enumerate(k.body):
        if t in outs:
            continue
        rest = []
        for t2, e2 in k.body[i + 1:]:
            rest.append((t2, _subst(e2, t, e)))
        yield KernelDef(k.name, list(k.inputs), list(k.outputs), k.body[:i] + rest)
    # 3. replace subexpressions: by a child, by a literal, by a parameter of the same type
    types = None
    try:
        types = Checker(k)
        types.check()
    except ModelError:
        return
    for i, (t, e) in enumerate(k.body):
        for path, node in _paths(e):
            kids = children(node)
            for c in kids:
                yield _with_stmt(k, i, _replace(e, path, c))
            if isinstance(node, (Num, Ref)):
                continue
            ty = types.types.get(node)
            if ty is None:
                continue
            if not ty.shape:
                lit = Num(1.0, "1") if ty.dtype in INTS else Num(0.5, "0.5")
                yield _with_stmt(k, i, _replace(e, path, lit))
                if ty.dtype == "f32":
                    yield _with_stmt(k, i, _replace(e, path, Fn("f32", (Num(1.0, "1"),))))
            for p in k.inputs:
                if p.shape == ty.shape and p.dtype == ty.dtype and p.name not in k.inplace:
                    yield _with_stmt(k, i, _replace(e, path, Ref(p.name)))
            if ty.shape and ty.dtype != "float":
                name = _fresh(k, "z")
                k2 = _with_stmt(k, i, _replace(e, path, Ref(name)))
                lead = ty.shape[:ty.shape.index(SEQ)] if SEQ in ty.shape else ()   # batch axes before T: optional
                k2.inputs = k2.inputs + [Param(name, ty.dtype, ty.shape, lead)]
                yield k2
    # 4. drop an axis from an input (every use must still type)
    for j, p in enumerate(k.inputs):
        for a in p.shape:
            q = _without_axis(p, a)
            if not q.shape:
                continue
            yield KernelDef(k.name, k.inputs[:j] + [q] + k.inputs[j + 1:], list(k.outputs), list(k.body))
    # 5. drop an axis from an output
    for j, o in enumerate(k.outputs):
        for a in o.shape:
            q = _without_axis(o, a)
            if q.shape:
                yield KernelDef(k.name, list(k.inputs), k.outputs[:j] + [q] + k.outputs[j + 1:], list(k.body))
    # 6. drop a default (of an input the call passes), an optional mark
    for j, p in enumerate(k.inputs):
        if p.default is not None and p.name not in case.left_out:
            q = dataclasses.replace(p, default=None)
            yield KernelDef(k.name, k.inputs[:j] + [q] + k.inputs[j + 1:], list(k.outputs), list(k.body))
    for group in ("inputs", "outputs"):
        params = getattr(k, group)
        for j, p in enumerate(params):
            if p.optional and SEQ not in p.shape and not (p.name in k.inplace):
                q = dataclasses.replace(p, optional=())
                new = params[:j] + [q] + params[j + 1:]
                yield KernelDef(k.name, new if group == "inputs" else list(k.inputs),
                                new if group == "outputs" else list(k.outputs), list(k.body))


def _without_axis(p: Param, a: str) -> Param:
    return dataclasses.replace(p, shape=tuple(x for x in p.shape if x != a),
                               optional=tuple(x for x in p.optional if x != a))


def call_variants(case: Case):
    """The same kernel called more simply: no poison, defaulted inputs passed, optional axes passed."""
    if case.poison:
        yield _clone(case, poison=False)
    for n in case.left_out:
        yield _clone(case, left_out=tuple(x for x in case.left_out if x != n))
    if case.dropped:
        yield _clone(case, dropped=case.dropped[:-1])


def _fresh(k: KernelDef, stem: str) -> str:
    names = {p.name for p in k.inputs} | {t for t, _ in k.body}
    i = 0
    while f"{stem}{i}" in names:
        i += 1
    return f"{stem}{i}"


def _with_stmt(k: KernelDef, i: int, e: Expr) -> KernelDef:
    body = list(k.body)
    body[i] = (body[i][0], e)
    return KernelDef(k.name, list(k.inputs), list(k.outputs), body)


def _subst(e: Expr, name: str, value: Expr) -> Expr:
    if isinstance(e, Ref) and e.name == name:
        return value
    kids = children(e)
    return with_children(e, tuple(_subst(c, name, value) for c in kids)) if kids else e


def size_variants(case: Case):
    yield from call_variants(case)
    if case.bucket == 8:
        T = case.sizes.get("T")
        if T is None or (T % 4 == 0 if _packed(case) else T % 4):
            yield _clone(case, bucket=4)
    for a, n in case.sizes.items():
        for m in range(1, n):
            if a == "T" and m % case.bucket == 0 and not _packed(case):
                continue
            if a == "T" and m % case.bucket and _packed(case):
                continue
            s = dict(case.sizes)
            s[a] = m
            yield _clone(case, sizes=s)


def _packed(case: Case) -> bool:
    """Several sequences in one tensor (a batch axis of size > 1): T stays a multiple of the bucket."""
    return any(case.sizes.get(a, 1) > 1 for a in ("B", "C"))


def _complexity(case: Case) -> tuple:
    k = case.kernel
    nodes = sum(1 for _, e in k.body for _ in walk(e))
    return (len(k.body) + len(k.outputs), nodes, len(k.inputs), sum(case.sizes.values()))


def shrink(case: Case, runner: Runner, pred: Callable[[Result], bool], budget: int = 600,
           log: Callable[[str], None] | None = None) -> Case:
    """The smallest variant of ``case`` found within ``budget`` runs for which ``pred`` holds."""
    runs = 0

    def fails(c: Case) -> bool:
        nonlocal runs
        runs += 1
        try:
            return pred(runner.run(c))
        except ModelError:
            return False

    best = _clone(case, prune(case.kernel))
    if not fails(best):
        best = case
    improved = True
    while improved and runs < budget:
        improved = False
        for k2 in variants(best):
            if runs >= budget:
                break
            k2 = prune(k2)
            if not _well_typed(k2):
                continue
            cand = _clone(best, k2, sizes={a: n for a, n in best.sizes.items() if a in k2.axes()})
            if _complexity(cand) >= _complexity(best):
                continue
            if fails(cand):
                best = cand
                improved = True
                if log:
                    log(f"  shrunk to {_complexity(best)} after {runs} runs")
                break
        if improved:
            continue
        for cand in size_variants(best):
            if runs >= budget:
                break
            if fails(cand):
                best = cand
                improved = True
                break
    return best

