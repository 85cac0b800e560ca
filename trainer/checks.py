"""Checks of settings: builder and constructor arguments and the public attributes they set.

A value of the wrong kind (a string, a bool where a number is meant, None where it is not allowed)
is a ``TypeError``; a number out of range, NaN or infinite is a ``ValueError``. Either names the
setting, the value and what was expected, and is raised before anything changes.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _bounds(minimum=None, above=None, below=None, maximum=None) -> str:
    lo = f">= {minimum:g}" if minimum is not None else f"> {above:g}" if above is not None else None
    hi = f"<= {maximum:g}" if maximum is not None else f"< {below:g}" if below is not None else None
    if lo and hi:
        left = "[" if minimum is not None else "("
        right = "]" if maximum is not None else ")"
        return f"in {left}{minimum if minimum is not None else above:g}, " \
               f"{maximum if maximum is not None else below:g}{right}"
    return lo or hi or ""


def is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def integer(what: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            extra: str = "") -> int:
    """``value`` as an int (a bool is refused), within [minimum, maximum]."""
    expected = " ".join(x for x in ("an integer", _bounds(minimum=minimum, maximum=maximum), extra) if x)
    if is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be {expected}, got {_got(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{what} must be {expected}, got {value}")
    return value


def real(what: str, value: Any, *, minimum: float | None = None, above: float | None = None,
         below: float | None = None, maximum: float | None = None) -> float:
    """``value`` as a finite float (a bool or a string is refused) within the given bounds."""
    expected = " ".join(x for x in ("a finite number", _bounds(minimum, above, below, maximum)) if x)
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be {expected}, got {_got(value)}")
    value = float(value)
    if (not math.isfinite(value) or (minimum is not None and value < minimum)
            or (above is not None and value <= above) or (below is not None and value >= below)
            or (maximum is not None and value > maximum)):
        raise ValueError(f"{what} must be {expected}, got {value!r}")
    return value


def boolean(what: str, value: Any) -> bool:
    if not is_bool(value):
        raise TypeError(f"{what} must be True or False, got {_got(value)}")
    return bool(value)


def instance(what: str, value: Any, cls: type | tuple[type, ...], expected: str, optional: bool = True):
    """``value`` when it is a ``cls`` (or None, when ``optional``)."""
    if (value is None and optional) or isinstance(value, cls):
        return value
    raise TypeError(f"{what} must be {expected}{' or None' if optional else ''}, got {_got(value)}")


class Checked:
    """A public attribute every assignment of which goes through ``check(label, value, **bounds)``
    (one of the checks above), from the class's own code and its users alike; the value lives in
    ``_<name>``. The label is ``label`` with ``{name}`` and ``{kind}`` (the owner's ``kind``, as
    the optimizers have it) filled in."""

    def __init__(self, check, label: str = "{name}", **bounds):
        self.check, self.label, self.bounds = check, label, bounds

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, value) -> None:
        what = self.label.format(name=self.name, kind=getattr(obj, "kind", ""))
        setattr(obj, self.slot, self.check(what, value, **self.bounds))
