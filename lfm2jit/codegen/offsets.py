"""The offsets the GEMM and attention templates index with, built as typed values (spelled by the
``wgsl`` filter, as the pointwise template's indices are) instead of strings joined in Jinja.

An index is schedule/code.py's ``Var``, ``Const`` or ``Bin``, or one of the two n-ary nodes below.
Nothing is folded: ``0u * 40u`` stays as the template wrote it, so the WGSL reads as the formula.
Arguments may be given as an ``int`` (a u32 constant) or a WGSL name (a ``str``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..schedule.code import Bin, Const, Var

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Sum:
    """``a + b + ... - m ...``; a Sum inside another node is parenthesised."""
    terms: tuple
    minus: tuple = ()


@dataclass(frozen=True)
class Product:
    """``a * b * ...``; Sum and Bin factors are parenthesised."""
    factors: tuple


def index(x):
    """An int as a u32 constant, a str as the WGSL variable of that name, an index as itself."""
    if isinstance(x, bool):
        raise TypeError(f"{x!r} is not an index")
    if isinstance(x, int):
        return Const(x)
    if isinstance(x, str):
        if not _NAME.fullmatch(x):
            raise ValueError(f"{x!r} is not a WGSL name (build expressions as typed values)")
        return Var(x)
    return x


def plus(*terms, minus=()) -> Sum:
    return Sum(tuple(index(t) for t in terms), tuple(index(t) for t in minus))


def times(*factors) -> Product:
    return Product(tuple(index(f) for f in factors))


def tile_at(major, minor, stride, base=None) -> Sum:
    """Element (major, minor) of a tile in workgroup memory, ``major`` steps ``stride`` apart:
    ``[base +] major * stride + minor``, a sum ``minor`` written out flat."""
    minor = index(minor)
    rest = minor.terms if isinstance(minor, Sum) and not minor.minus else (minor,)
    return plus(*(() if base is None else (base,)), times(major, stride), *rest)


def operand_at(op) -> Sum:
    """Where a GEMM operand's element (row gr, k gk) of batch ``batch`` lies (schedule/matmul.py's
    Operand): in vec4s for "k"- or "m"-contiguous reads, else in elements."""
    if op.vec == "k":
        return plus(times("batch", op.sb // 4), times("gr", op.sm // 4), Bin("/", Var("gk"), Const(4)))
    if op.vec == "m":
        return plus(times("batch", op.sb // 4), Bin("/", Var("gr"), Const(4)), times("gk", op.sk // 4))
    return plus(times("batch", op.sb), times("gr", op.sm), times("gk", op.sk))


def fragment_at(p, ly, side: str, stage: int, kk: int, f: int) -> Sum:
    """Where this subgroup's fragment ``f`` of operand ``side`` ("a": along M from sm0, "b": along N
    from sn0) starts for k-step ``kk``, in stage ``stage`` of its tile laid out as ``ly``
    (schedule/matmul.py's StageLayout: [k][rows] when by_k, else [rows][k]), in the tile's array
    elements: the contiguous coordinate counts whole vec4s where the tile holds vec4s (ly.unit 4).
    With groups of subgroups along K (MatrixTiles.sg_k), ``kk`` counts within this group's share
    of the step, which starts at k = sk0."""
    k, u = kk * p.frag.k, ly.unit
    if side == "a":
        first, row, stride, by_k, base = "sm0", f * p.frag.m, ly.a_stride, ly.a_by_k, stage * ly.a_tile
    else:
        first, row, stride, by_k, base = "sn0", f * p.frag.n, ly.b_stride, ly.b_by_k, stage * ly.b_tile
    if by_k:
        return tile_at(plus("sk0", k) if p.tiles.sg_k > 1 else k,
                       plus(Bin("/", Var(first), Const(u)) if u > 1 else first, row // u), stride, base)
    along_k = k // u
    if p.tiles.sg_k > 1:
        along_k = plus(Bin("/", Var("sk0"), Const(u)) if u > 1 else "sk0", along_k)
    return tile_at(plus(first, row), along_k, stride, base)


def ws_at(p, gm, gn) -> Sum:
    """Where element (gm, gn) of C lies in split-K's workspace [batch, split, M, N - split_n0]."""
    row = plus(times(plus(times("batch", "SPLIT"), "slice"), p.m_pad), gm)
    return plus(times(row, p.n_size - p.split_n0), gn, minus=(p.split_n0,) if p.split_n0 else ())


def c_at(p, i: int, j: int, dest: str) -> Sum:
    """Where this subgroup's accumulator fragment (i, j) starts in C ("c") or the workspace ("ws")."""
    gm = plus("m0", "sm0", i * p.frag.m)
    gn = plus("n0", "sn0", j * p.frag.n)
    if dest == "ws":
        return ws_at(p, gm, gn)
    return plus(times("batch", p.c.sb), times(gm, p.c.sm), gn)
