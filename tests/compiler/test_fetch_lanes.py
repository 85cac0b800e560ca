"""The lanes of a vec4 fetch of a computed operand (lfm2jit/schedule/lanes.py): every value the
analysis says the four lanes share is equal in all four, checked by evaluating random integer
expressions exactly (u32 and i32 wrap-around, WGSL's shifts) at many indices; and the decoded
GEMMs' words and scales are loaded once a vec4."""
import numpy as np
import pytest

from lfm2jit import library
from lfm2jit.ir.ops import Op
from lfm2jit.schedule.code import Apply, Bin, Const, IndexValue, Let, Lit, Load, Ref, Var
from lfm2jit.schedule.lanes import shared_lets

BINARY = (Op.ADD, Op.SUB, Op.MUL, Op.SHR, Op.SHL, Op.BITAND, Op.BITOR, Op.MOD)


def _random_lets(rng: np.random.Generator, n: int) -> list[Let]:
    """n lets of u32 (some i32) arithmetic over gk (the lane axis), gr and literals, each reading
    earlier ones; some are loads of a table at an earlier value."""
    lets = [Let("l0", "i32", IndexValue(Var("gk"), "i32")), Let("l1", "u32", Apply(Op.CAST, (Ref("l0"),), "u32", ("i32",))),
            Let("l2", "u32", IndexValue(Bin("*", Var("gr"), Const(int(rng.choice([1, 3, 64, 2048])))), "u32"))]
    lets.append(Let("l3", "u32", Apply(Op.ADD, (Ref("l2"), Ref("l1")), "u32", ("u32", "u32"))))
    for i in range(4, n):
        a = Ref(f"l{rng.integers(max(0, i - 4), i) if rng.random() < 0.7 else rng.integers(0, i)}")   # mostly chains
        a = a if lets[int(a.name[1:])].ctype == "u32" else Apply(Op.CAST, (a,), "u32", ("i32",))
        kind = rng.random()
        if kind < 0.1:
            lets.append(Let(f"l{i}", "u32", Load("table", Var(a.name) if isinstance(a, Ref) else Var(f"l{i - 1}"), "u32")))
            continue
        op = BINARY[rng.integers(0, len(BINARY))]
        if rng.random() < 0.6:
            b = Lit(float(rng.choice([1, 2, 3, 4, 6, 7, 8, 15, 16, 64, 255] if op not in (Op.SHR, Op.SHL) else [1, 2, 3, 4, 6])), "u32")
        else:
            b = Ref(f"l{rng.integers(0, i)}")
            b = b if lets[int(b.name[1:])].ctype == "u32" else Apply(Op.CAST, (b,), "u32", ("i32",))
        lets.append(Let(f"l{i}", "u32", Apply(op, (a, b), "u32", ("u32", "u32"))))
    return lets


def _evaluate(lets: list[Let], gk: int, gr: int, table: np.ndarray) -> dict[str, int]:
    """Each let's value, as WGSL computes it (u32 wraps; shifts take the amount modulo 32)."""
    env: dict[str, int] = {}

    def idx(x):
        if isinstance(x, Var):
            return {"gk": gk, "gr": gr}.get(x.name, env.get(x.name))
        if isinstance(x, Const):
            return x.value
        a, b = idx(x.a), idx(x.b)
        return {"+": a + b, "*": a * b, "|": a | b}[x.op]

    def val(v):
        if isinstance(v, Ref):
            return env[v.name]
        if isinstance(v, Lit):
            return int(v.value)
        if isinstance(v, IndexValue):
            return idx(v.index) & 0xFFFFFFFF
        if isinstance(v, Load):
            return int(table[idx(v.offset) % len(table)])
        a, *rest = (val(x) for x in v.args)
        if v.op == Op.CAST:
            return a & 0xFFFFFFFF
        b = rest[0]
        out = {Op.ADD: a + b, Op.SUB: a - b, Op.MUL: a * b, Op.SHR: a >> (b & 31), Op.SHL: a << (b & 31),
               Op.BITAND: a & b, Op.BITOR: a | b, Op.MOD: a % b if b else 0}[v.op]
        return out & 0xFFFFFFFF

    for let in lets:
        env[let.name] = val(let.value)
    return env


@pytest.mark.parametrize("seed", range(100))
def test_what_the_lanes_share_is_equal_in_every_lane(seed):
    rng = np.random.default_rng(seed)
    lets = _random_lets(rng, 24)
    shared = shared_lets(lets, "gk")
    table = rng.integers(0, 2 ** 32, 97, dtype=np.uint64)
    for _ in range(60):
        gk = 4 * int(rng.integers(0, 2 ** 28))
        gr = int(rng.integers(0, 2 ** 20))
        lane0 = _evaluate(lets, gk, gr, table)
        for j in (1, 2, 3):
            lane = _evaluate(lets, gk | j, gr, table)
            for name in shared:
                assert lane[name] == lane0[name], (name, j, gk, gr, [str(x) for x in lets])


def test_a_shift_below_the_lanes_is_not_shared():
    """(gk + 2) >> 1 differs between lanes; (gr * 8 + gk) >> 2 and >> 3 do not, >> 1 does."""
    lets = [Let("a", "u32", IndexValue(Var("gk"), "u32")),
            Let("b", "u32", Apply(Op.ADD, (Ref("a"), Lit(2.0, "u32")), "u32", ("u32", "u32"))),
            Let("c", "u32", Apply(Op.SHR, (Ref("b"), Lit(1.0, "u32")), "u32", ("u32", "u32"))),
            Let("d", "u32", IndexValue(Bin("+", Bin("*", Var("gr"), Const(8)), Var("gk")), "u32")),
            Let("e", "u32", Apply(Op.SHR, (Ref("d"), Lit(2.0, "u32")), "u32", ("u32", "u32"))),
            Let("f", "u32", Apply(Op.SHR, (Ref("d"), Lit(3.0, "u32")), "u32", ("u32", "u32"))),
            Let("g", "u32", Apply(Op.SHR, (Ref("d"), Lit(1.0, "u32")), "u32", ("u32", "u32")))]
    assert shared_lets(lets, "gk") == {"e", "f"}


@pytest.mark.parametrize("kernel, tables", [("linear_nf4", ("codes", "absmax")), ("linear_int8", ("codes",))])
def test_a_decoded_weight_is_read_once_a_vec4(kernel, tables):
    """The matrix template's fetch of an NF4 (int8) weight: lane 0 loads the codes' word and the
    block's absmax (the word) for all four lanes; each lane looks up only its own code."""
    from lfm2jit.schedule.matmul import computed_operand
    from lfm2jit.tune.tiles import MatrixTiles
    ir = library.get(kernel).without({"r"}).kernels[0].ir
    product = ir.results["y"].srcs[0]                      # sum(x * w, K): x * w
    (w,) = [n for n in product.srcs if n.op != Op.INPUT]
    sizes = {"T": 64, "N": 128, "K": 256, "P": 128 * 256 // 8, "B": 128 * 256 // 64, "C": 16}
    op = computed_operand(w, "w", "N", "K", None, sizes, MatrixTiles(64, 64), 64)
    assert op.vec == "k" and len(op.lanes) == 3
    loads = [x for x in op.fetch if isinstance(x.value, Load)]
    for t in tables:
        assert [x.name[:4] for x in loads if x.value.tensor == t] == ["pf0_"], t
    if kernel == "linear_nf4":                             # the codebook: one lookup a lane
        assert sorted(x.name[:4] for x in loads if x.value.tensor == "code") == ["pf0_", "pf1_", "pf2_", "pf3_"]
