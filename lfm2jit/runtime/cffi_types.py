"""Faster first use of each C type in wgpu-native's bindings.

wgpu-py reaches wgpu-native through cffi in ABI mode: the first ``ffi.new("WGPUSomething *")`` of
each type string parses it with pycparser behind a preamble that declares every typedef of the
header as a type name, about 430 lines parsed again for each of the few dozen types a run uses
(most of a warm start on a CPU adapter). The preamble only matters for names the parsed text
mentions, so ``parse_only_named_typedefs`` shows cffi's parser just those while it parses a type;
the types it returns are cffi's own (tests/runtime/test_cffi_types.py compares them). Dawn's
bindings are compiled (cffi's API mode) and parse types without pycparser.
"""
from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_]\w*")
TYPEDEF = "typedef "


def parse_only_named_typedefs(ffi) -> bool:
    """Make ``ffi``'s type parser declare only the typedefs a type string names; False (nothing
    changed) where this cffi's parser lacks what that needs."""
    parser = getattr(ffi, "_parser", None)
    parse = getattr(parser, "parse_type_and_quals", None)
    if parse is None or not isinstance(getattr(parser, "_declarations", None), dict):
        return False
    if getattr(parse, "only_named_typedefs", False):
        return True

    def parse_type_and_quals(cdecl):
        everything = parser._declarations
        named = {TYPEDEF + name for name in _NAME.findall(cdecl)}
        shown = {k: v for k, v in everything.items() if not k.startswith(TYPEDEF) or k in named}
        parser._declarations = shown
        try:
            return parse(cdecl)
        finally:
            parser._declarations = everything
            for key in shown.keys() - everything.keys():      # anything the parse declared is kept
                everything[key] = shown[key]

    parse_type_and_quals.only_named_typedefs = True
    parser.parse_type_and_quals = parse_type_and_quals
    return True
