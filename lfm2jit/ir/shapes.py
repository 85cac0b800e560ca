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


def plus_one(axis: str) -> str:
    """The axis one longer than ``axis`` (a bucket sort's offsets [V + 1]): "V+1", or "9" for "8"."""
    return str(int(axis) + 1) if axis.isdigit() else f"{axis}+1"


def minus_one(axis: str) -> str | None:
    """The axis ``plus_one`` made this one from, or None when it is not one."""
    if axis.isdigit():
        return str(int(axis) - 1) if int(axis) > 1 else None
    return axis[:-2] if axis.endswith("+1") else None


def derived_size(axis: str, sizes: dict[str, int]) -> int | None:
    """The size of an axis that its name fixes: an integer axis ("3"), "V+1" once V has a size, or
    V once "V+1" has one (offsets passed to a kernel size the keys)."""
    if axis.isdigit():
        return int(axis)
    if axis.endswith("+1") and axis[:-2] in sizes:
        return sizes[axis[:-2]] + 1
    if not axis.endswith("+1") and f"{axis}+1" in sizes:
        return sizes[f"{axis}+1"] - 1
    return None
