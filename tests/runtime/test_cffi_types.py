"""cffi's types parsed with only the named typedefs declared (lfm2jit/runtime/cffi_types.py) equal
cffi's own parse of the same strings, over wgpu-native's header: every kind of typedef it declares
(structs, enums, flags, callbacks), written as pointers, arrays and bare names."""
from __future__ import annotations

import random

import pytest

cffi = pytest.importorskip("cffi")
wgpu_ffi = pytest.importorskip("wgpu.backends.wgpu_native._ffi")

from lfm2jit.runtime.cffi_types import parse_only_named_typedefs  # noqa: E402


def fresh_ffi():
    ffi = cffi.FFI()
    ffi.cdef(wgpu_ffi.get_wgpu_header())
    return ffi


def described(ffi, cdecl: str) -> tuple:
    """What a parsed type is, comparable between FFI instances: its C name, size, and for a struct
    (or a pointer to one) each field's name, offset and type."""
    t = ffi.typeof(cdecl)
    item = t.item if t.kind in ("pointer", "array") else t
    fields = tuple((name, f.offset, f.type.cname) for name, f in item.fields) if item.kind == "struct" else ()
    size = ffi.sizeof(t) if t.kind != "function" and not (t.kind == "array" and t.length is None) else None
    return t.cname, t.kind, size, fields


def test_types_equal_cffis_own_parse():
    ours, theirs = fresh_ffi(), fresh_ffi()
    assert parse_only_named_typedefs(ours)
    names = sorted(k[len("typedef "):] for k in ours._parser._declarations if k.startswith("typedef WGPU"))
    assert len(names) > 100
    rng = random.Random(7)
    # cffi's own parse takes tens of ms a type: a seeded sample of each spelling
    cases = [f"{n} *" for n in rng.sample(names, 24)] + [f"{n}[]" for n in rng.sample(names, 8)]
    cases += [n for n in rng.sample(names, 8)] + ["uint32_t *", "WGPUBufferDescriptor*", "const WGPUChainedStruct *",
                                                   "WGPUFeatureName[4]"]
    for cdecl in cases:
        try:
            expected = described(theirs, cdecl)
        except cffi.CDefError as e:          # e.g. an opaque handle's struct as a bare name: refused alike
            with pytest.raises(cffi.CDefError):
                described(ours, cdecl)
            assert str(e)
            continue
        assert described(ours, cdecl) == expected, cdecl


def test_unknown_names_are_still_refused():
    ffi = fresh_ffi()
    parse_only_named_typedefs(ffi)
    with pytest.raises(cffi.CDefError):
        ffi.typeof("WGPUNoSuchThing *")
    assert described(ffi, "WGPUBufferDescriptor *")[1] == "pointer"    # a failed parse leaves it working


def test_applied_once():
    ffi = fresh_ffi()
    assert parse_only_named_typedefs(ffi) and parse_only_named_typedefs(ffi)
    first = ffi._parser.parse_type_and_quals
    parse_only_named_typedefs(ffi)
    assert ffi._parser.parse_type_and_quals is first
