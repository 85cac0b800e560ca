"""Source text -> AST, through a LALR grammar; every failure becomes a located DslError."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from lark import Lark, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from . import ast
from .errors import DslError

_TOKEN_WORDS = {
    "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "LBRACE": "'{'", "RBRACE": "'}'",
    "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "PLUS": "'+'", "MINUS": "'-'", "STAR": "'*'",
    "SLASH": "'/'", "MORETHAN": "'>'", "LESSTHAN": "'<'", "__ANON_0": "'->'", "__ANON_1": "'**'",
    "KERNEL": "'kernel'", "NAME": "a name", "INT": "an integer", "NUMBER": "a number",
    "DTYPE": "a dtype (f32, f16, i32, u32)", "$END": "end of input",
}


@lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = resources.files("lfm2jit.dsl").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _loc(meta_or_token) -> ast.Loc:
    return ast.Loc(getattr(meta_or_token, "line", 0) or 0, getattr(meta_or_token, "column", 0) or 0)


@v_args(meta=True)
class _ToAst(Transformer):
    def start(self, meta, kernels):
        return tuple(kernels)

    def kernel(self, meta, children):
        name, ins, outs, *body = children
        return ast.KernelDef(str(name), tuple(ins or ()), tuple(outs), tuple(body), _loc(name))

    def params(self, meta, items):
        return tuple(items)

    def param(self, meta, children):
        name, typ = children
        return ast.Param(str(name), typ, _loc(name))

    def type(self, meta, children):
        dtype, dims = children
        return ast.TypeSpec(str(dtype), tuple(dims or ()), _loc(dtype))

    def shape(self, meta, dims):
        return tuple(dims)

    def dim_name(self, meta, children):
        return str(children[0])

    def dim_size(self, meta, children):
        return int(children[0])

    def stmt(self, meta, children):
        name, value = children
        return ast.Assign(str(name), value, _loc(name))

    def number(self, meta, children):
        tok = children[0]
        return ast.Number(float(tok), str(tok), _loc(tok))

    def var(self, meta, children):
        tok = children[0]
        return ast.Var(str(tok), _loc(tok))

    def call(self, meta, children):
        name, args = children
        return ast.Call(str(name), tuple(args or ()), _loc(name))

    def args(self, meta, items):
        return tuple(items)

    def neg(self, meta, children):
        return ast.Neg(children[0], _loc(meta))

    def _binop(op):  # noqa: N805 - builds one method per binary rule
        def method(self, meta, children):
            lhs, rhs = children
            return ast.BinOp(op, lhs, rhs, _loc(meta))
        return method

    add, sub, mul, div = _binop("add"), _binop("sub"), _binop("mul"), _binop("div")
    pow, lt, gt = _binop("pow"), _binop("lt"), _binop("gt")


def _expected(exc: UnexpectedInput) -> str:
    names = sorted(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    words = sorted({_TOKEN_WORDS.get(n, n) for n in names})
    return ", ".join(words) if words else "valid kernel syntax"


def parse(text: str, filename: str = "<source>") -> ast.SourceFile:
    """Parse kernel source text. Raises DslError (never a lark or Python error) on bad input."""
    if not isinstance(text, str):
        raise TypeError(f"kernel source must be str, got {type(text).__name__}")
    try:
        tree = _lark().parse(text)
        kernels = _ToAst().transform(tree)
    except UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            what, (line, col) = "end of input", _end(text)
        else:
            word = _TOKEN_WORDS.get(tok.type)
            what = f"{word} {str(tok)!r}" if tok.type in ("NAME", "INT", "NUMBER", "DTYPE") else (word or repr(str(tok)))
            line, col = e.line, e.column
        raise DslError(f"unexpected {what}", filename=filename, line=line, column=col, source=text,
                       expected=_expected(e)) from None
    except UnexpectedCharacters as e:
        ch = text[e.pos_in_stream] if 0 <= e.pos_in_stream < len(text) else "?"
        raise DslError(f"unexpected character {ch!r}", filename=filename, line=e.line, column=e.column,
                       source=text, expected=_expected(e)) from None
    except UnexpectedEOF as e:
        line, col = _end(text)
        raise DslError("unexpected end of input", filename=filename, line=line, column=col, source=text,
                       expected=_expected(e)) from None
    except VisitError as e:  # a malformed literal that the grammar let through, e.g. a huge exponent
        raise DslError(f"invalid literal: {e.orig_exc}", filename=filename, source=text) from None
    return ast.SourceFile(filename, text, kernels)


def _end(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1
