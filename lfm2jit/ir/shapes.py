"""Axis-name shape algebra shared by the checker and autodiff."""
from __future__ import annotations


def is_subsequence(small: tuple[str, ...], big: tuple[str, ...]) -> bool:
    it = iter(big)
    return all(a in it for a in small)


def merge(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
    """The broadcast shape of two operands, by axis name, or None when their orders conflict.

    Shared axes must appear in the same relative order in both. Axes only ``b`` has are placed
    just before the next shared axis that follows them in ``b`` (or at the end), so
    [T, K] with [N, K] gives [T, N, K]: the shape of a contraction over K before it is reduced.
    """
    shared = [x for x in a if x in b]
    if shared != [x for x in b if x in a]:
        return None
    out: list[str] = []
    pending: list[str] = []
    b_only_before: dict[str, list[str]] = {}
    for x in b:
        if x in a:
            b_only_before[x] = pending
            pending = []
        else:
            pending.append(x)
    for x in a:
        out.extend(b_only_before.get(x, []))
        out.append(x)
    out.extend(pending)
    return tuple(out)
