"""Source text -> AST, through a LALR grammar; every failure becomes a located DslError."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from lark import Lark, Transformer_NonRecursive, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from lark.lexer import PatternStr

from . import ast
from .errors import DslError

# How the pattern-defined terminals read in "expected ..." lists; punctuation and keywords are
# spelled from the grammar itself (see _word), so anonymous terminal names never leak into messages.
_TOKEN_WORDS = {
    "NAME": "a name", "INT": "an integer", "NUMBER": "a number",
    "DTYPE": "a dtype (f32, f16, i32, u32)", "$END": "end of input",
}
# ...and how an unexpected token of those kinds is introduced: "unexpected name 'x'"
_TOKEN_NOUNS = {"NAME": "name", "INT": "integer", "NUMBER": "number", "DTYPE": "dtype"}

# Expressions nest at most this deep (parentheses alone do not count; operators, negations and calls
# do). The checker and later passes walk expressions recursively, so a bound here turns a would-be
# RecursionError on absurd input into a located DslError; real kernels stay far below it.
MAX_EXPR_DEPTH = 200
# Integer axis sizes are baked into WGSL as u32 constants; keep them, and their products' factors, sane.
MAX_AXIS_SIZE = 2**31 - 1


@lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = resources.files("lfm2jit.dsl").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _loc(meta_or_token) -> ast.Loc:
    return ast.Loc(getattr(meta_or_token, "line", 0) or 0, getattr(meta_or_token, "column", 0) or 0)


def _word(name: str) -> str:
    """How terminal ``name`` reads in an error message."""
    if name in _TOKEN_WORDS:
        return _TOKEN_WORDS[name]
    for t in _lark().terminals:
        if t.name == name and isinstance(t.pattern, PatternStr):
            return repr(t.pattern.value)
    return name


@v_args(meta=True)
class _ToAst(Transformer_NonRecursive):
    """Parse tree -> AST without recursion, so any nesting depth transforms (the depth is checked after)."""

    def __init__(self, filename: str, text: str):
        super().__init__()
        self.filename = filename
        self.text = text

    def start(self, meta, kernels):
        return tuple(kernels)

    def kernel(self, meta, children):
        name, ins, outs, *body = children
        return ast.KernelDef(str(name), tuple(ins or ()), tuple(outs), tuple(body), _loc(name))

    def params(self, meta, items):
        return tuple(items)

    def param(self, meta, children):
        name, typ, default = children
        return ast.Param(str(name), typ, _loc(name), default)

    def default_number(self, meta, children):
        return float(children[0])

    def default_negative(self, meta, children):
        return -float(children[0])

    def type(self, meta, children):
        dtype, dims = children
        dims = dims or ()
        return ast.TypeSpec(str(dtype), tuple(d for d, _, _ in dims), _loc(dtype), tuple(loc for _, loc, _ in dims),
                            tuple(d for d, _, optional in dims if optional))

    def shape(self, meta, dims):
        return tuple(dims)

    # a dim is passed up as (name or size, location, optional) and split by ``type``
    def dim_name(self, meta, children):
        return str(children[0]), _loc(children[0]), False

    def dim_optional(self, meta, children):
        return str(children[0]), _loc(children[0]), True

    def dim_plus_one(self, meta, children):
        name, tok = children[0], children[-1]
        if str(tok).lstrip("0") != "1":
            raise DslError(f"axis {name} + {str(tok)[:20]}: only one past an axis can be named",
                           filename=self.filename, line=tok.line, column=tok.column, source=self.text,
                           expected=f"{name} + 1 (a bucket sort's offsets) or an axis name")
        return f"{name}+1", _loc(children[0]), False

    def dim_size(self, meta, children):
        tok = children[0]
        digits = str(tok).lstrip("0")
        if len(digits) > len(str(MAX_AXIS_SIZE)) or int(digits or "0") > MAX_AXIS_SIZE:
            raise DslError(f"axis size {str(tok)[:20]}{'...' * (len(tok) > 20)} is too large",
                           filename=self.filename, line=tok.line, column=tok.column, source=self.text,
                           expected=f"a size of at most {MAX_AXIS_SIZE}")
        return int(tok), _loc(tok), False

    def stmt(self, meta, children):
        *names, value = children
        return ast.Assign(tuple(str(n) for n in names), value, _loc(names[0]))

    def subscript(self, meta, children):
        value, items = children
        return ast.Subscript(value, items, _loc(meta))

    def subs(self, meta, items):
        return tuple(items)

    def full(self, meta, children):
        return ast.Full(_loc(meta))

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
            lhs, sym, rhs = children
            return ast.BinOp(op, lhs, rhs, _loc(sym))   # located at the operator
        return method

    add, sub, mul, div = _binop("add"), _binop("sub"), _binop("mul"), _binop("div")
    pow, lt, gt = _binop("pow"), _binop("lt"), _binop("gt")
    mod, bitand, bitor, shl, shr = _binop("mod"), _binop("bitand"), _binop("bitor"), _binop("shl"), _binop("shr")


def _expected(exc: UnexpectedInput) -> str:
    names = None
    if isinstance(exc, UnexpectedToken):
        try:  # what the parser really accepts here; ``expected`` can hold extras of merged LALR states
            names = exc.accepts
        except Exception:  # noqa: BLE001 - only a nicer message is lost
            names = None
    names = sorted(names or getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    words = sorted({_word(n) for n in names})
    return ", ".join(words) if words else "valid kernel syntax"


def _children(e: ast.Expr) -> tuple[ast.Expr, ...]:
    if isinstance(e, ast.BinOp):
        return (e.lhs, e.rhs)
    if isinstance(e, ast.Neg):
        return (e.operand,)
    if isinstance(e, ast.Call):
        return e.args
    if isinstance(e, ast.Subscript):
        return (e.value,) + tuple(i for i in e.items if not isinstance(i, ast.Full))
    return ()


def _check_depth(kernels: tuple[ast.KernelDef, ...], filename: str, text: str) -> None:
    """Reject expressions nested deeper than MAX_EXPR_DEPTH, located at the first node too deep."""
    for k in kernels:
        for st in k.body:
            stack = [(st.value, 1)]
            while stack:
                e, depth = stack.pop()
                if depth > MAX_EXPR_DEPTH:
                    raise DslError(f"expression nested more than {MAX_EXPR_DEPTH} levels deep",
                                   filename=filename, line=e.loc.line, column=e.loc.column, source=text,
                                   expected="a shallower expression (split it into several assignments)")
                stack.extend((c, depth + 1) for c in reversed(_children(e)))


def parse(text: str, filename: str = "<source>") -> ast.SourceFile:
    """Parse kernel source text. Raises DslError (never a lark or Python error) on bad input."""
    if not isinstance(text, str):
        raise TypeError(f"kernel source must be str, got {type(text).__name__}")
    try:
        tree = _lark().parse(text)
        kernels = _ToAst(filename, text).transform(tree)
    except UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            what, (line, col) = "end of input", _end(text)
        else:
            noun = _TOKEN_NOUNS.get(tok.type)
            what = f"{noun} {str(tok)!r}" if noun else repr(str(tok))
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
    except VisitError as e:  # a check made while building the AST (e.g. an axis size too large)
        if isinstance(e.orig_exc, DslError):
            raise e.orig_exc from None
        meta = getattr(e.obj, "meta", None)
        raise DslError(f"invalid source: {e.orig_exc}", filename=filename, line=getattr(meta, "line", 0),
                       column=getattr(meta, "column", 0), source=text) from None
    _check_depth(kernels, filename, text)
    return ast.SourceFile(filename, text, kernels)


def _end(text: str) -> tuple[int, int]:
    """Where input ran out: just after the last thing written (trailing blank lines would hide it)."""
    lines = text.rstrip(" \t\f\r\n").split("\n")
    return len(lines), len(lines[-1]) + 1
