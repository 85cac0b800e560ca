"""Contraction schedule: ``out[.., m, n] = sum_k a[.., m, k] * b[.., n, k]`` as a tiled GEMM.

The operands' axis order is free (x @ W^T, dY^T X and dY W are all the same template with other
strides). Two templates, one planner:

* ``matmul`` (SIMT, portable): one workgroup computes a BM x BN tile; each invocation a TM x TN
  micro-tile held in named accumulators; K advances BK at a time through workgroup memory.
* ``matmul_matrix`` (the matrix units, where the device has f16 subgroup matrices and an operand is
  stored as f16): subgroups multiply 16x16 fragments of f16 tiles staged in workgroup memory into
  f32 accumulators.

Both mask the edges, run an axis that is T only to the real length (padded rows never enter a
sum), and share the epilogue: accumulate, f16 or f32 output, split-K with a deterministic reduce.
The matrix template can also split K in the last tile columns only (``MatrixTiles.tail``), so the
tiles that would run in a last, mostly idle wave of workgroups are spread over more of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..ir.nodes import SEQ_AXIS, KernelIR, toposort
from ..ir.ops import Op
from ..ir.partition import find_contraction, gemm_axes
from ..tune import heuristics
from ..tune.tiles import MatrixTiles, TileConfig
from .code import COMPUTE_TYPE, Bin, Const, Index, Let, Value, Var
from .lanes import shared_lets
from .layout import extent, strides
from .lower import Lowerer
from .spec import PORTABLE, EntryPoint, MatrixConfig, Plan, Scratch

REDUCE_THREADS = 256
MAX_WORKGROUPS = 65535    # WebGPU's maxComputeWorkgroupsPerDimension (its default limit)


@dataclass(frozen=True)
class Operand:
    """A GEMM operand as the template reads it: strides along its row axis (M or N), K and the batch
    axis; whether K is its contiguous axis; how it is read from memory ("k" or "m" contiguous vec4s,
    or None: scalars); how many reads each invocation makes per k-step."""
    tensor: str
    dtype: str
    sm: int
    sk: int
    sb: int
    vec: str | None = None
    loads: int = 0
    # a computed operand (ir.partition.is_prologue): ``fetch`` computes its element (gr, gk) of this
    # batch as ``value`` (f32), reading the tensors it decodes; ``tensor`` then only names it, and
    # the strides are those of its logical layout (which invocation fetches which element). Fetched
    # by vec4s (``vec``), it computes the next three elements along that axis too (``lanes``).
    fetch: tuple[Let, ...] = ()
    value: Value | None = None
    lanes: tuple[Value, ...] = ()

    @property
    def k_fast(self) -> bool:
        return self.sk == 1

    @property
    def convert(self) -> bool:
        return self.value is None and self.dtype != "f32"


@dataclass(frozen=True)
class Output:
    tensor: str
    dtype: str
    sm: int
    sn: int
    sb: int
    accumulate: bool

    @property
    def convert(self) -> bool:
        return self.dtype != "f32"


@dataclass(frozen=True)
class Term:
    """One more contraction summed into the same output (y = x W^T + u B^T): a phase of the K
    loop that runs after the first, over its own K with its own operands."""
    a: Operand
    b: Operand
    k_ext: Index
    k: str


@dataclass(frozen=True)
class Grouping:
    """A grouped GEMM (schedule/grouped.py): each of ``experts`` owns the rows from where the one
    before it ends to ``ends[e]`` (an i32[E] tensor read on the device). ``over`` "m": those are
    output rows, B is the expert's matrix (the batch axis) and the grid's tile rows are the
    experts' tile rows laid end to end; "k": they are the sum's range, and batch e is expert e's
    output matrix."""
    ends: str
    experts: int
    over: str


@dataclass(frozen=True)
class GemmParams:
    """What both GEMM templates are given besides their tiles: extents, operands, output, split-K
    layout, the further terms of the sum, and the epilogue: ``lets`` computing the stored value
    (``result``) from the sum (bound as ``dot``) and values at the output element (gm, gn, batch);
    no lets and no result store the sum itself. ``also``: further outputs of the same shape stored
    from the same sum, each with its value (None: the sum itself), computed by the same lets."""
    m_ext: Index
    n_ext: Index
    k_ext: Index
    a: Operand
    b: Operand
    c: Output
    axes: tuple[str, str, str, str | None]     # (m, n, k, batch) axis names, for the comments
    m_pad: int                                 # split-K workspace layout [batch, split, m_pad, n_size]
    n_size: int
    batches: int
    reduce_threads: int
    more: tuple[Term, ...] = field(default=(), kw_only=True)
    epilogue: tuple[Let, ...] = field(default=(), kw_only=True)
    result: Value | None = field(default=None, kw_only=True)
    also: tuple[tuple[Output, Value | None], ...] = field(default=(), kw_only=True)
    group: Grouping | None = field(default=None, kw_only=True)

    @property
    def split_n0(self) -> int:      # split-K's workspace holds every column (see MatrixParams)
        return 0

    @property
    def terms(self) -> tuple[Term, ...]:
        """Every phase of the K loop, the first one's operands first."""
        return (Term(self.a, self.b, self.k_ext, self.axes[2]),) + self.more


@dataclass(frozen=True)
class MatmulParams(GemmParams):
    tiles: TileConfig

    @property
    def threads(self) -> int:
        return self.tiles.threads


@dataclass(frozen=True)
class StageLayout:
    """One phase's workgroup tiles: whether each is staged [k][rows], and its row stride and
    elements per stage, counted in the tiles' array elements of ``unit`` f16 (MatrixTiles.unit)."""
    a_by_k: bool
    b_by_k: bool
    a_stride: int
    a_tile: int
    b_stride: int
    b_tile: int
    unit: int = 1


@dataclass(frozen=True)
class MatrixParams(GemmParams):
    tiles: MatrixTiles
    frag: MatrixConfig
    subgroup_size: int
    emulated: bool = False          # subgroup-matrix operations written out in plain WGSL (Target.emulated)
    epilogue_frags: int = 1         # accumulator fragments each subgroup puts through workgroup memory at once

    def __post_init__(self):
        """vec4-typed tiles (MatrixTiles.vec4) are staged one fetched vec4 a store: every operand
        must be read as vec4s."""
        scalar = [op.tensor for t in self.terms for op in (t.a, t.b) if op.vec is None]
        if self.tiles.vec4 and scalar:
            raise ValueError(f"tiles {self.tiles.label} stage vec4s; operands read element by element: {', '.join(scalar)}")

    @property
    def threads(self) -> int:
        return self.tiles.subgroups * self.subgroup_size

    @property
    def fm(self) -> int:            # accumulator fragments per subgroup along M
        return self.tiles.wm // self.tiles.sg_m // self.frag.m

    @property
    def fn(self) -> int:            # ... and along N
        return self.tiles.wn // self.tiles.sg_n // self.frag.n

    def layout(self, term: Term) -> "StageLayout":
        """How one phase stages its operands: a tile [k][rows] where the operand's rows are
        contiguous in memory, [rows][k] where K is (see MatrixTiles.staged)."""
        u = self.tiles.unit
        a_stride, a_tile = self.tiles.staged(self.tiles.wm, not term.a.k_fast)
        b_stride, b_tile = self.tiles.staged(self.tiles.wn, not term.b.k_fast)
        return StageLayout(not term.a.k_fast, not term.b.k_fast, a_stride // u, a_tile // u, b_stride // u, b_tile // u, u)

    @property
    def stage_words(self) -> tuple[int, int]:
        """Array elements of one stage of As and Bs: room for every phase's layout."""
        layouts = [self.layout(t) for t in self.terms]
        return max(ly.a_tile for ly in layouts), max(ly.b_tile for ly in layouts)

    @property
    def tiles_x(self) -> int:       # tile columns (along N) ...
        return -(-self.n_size // self.tiles.wn)

    @property
    def tiles_y(self) -> int:       # ... and tile rows (along M)
        return -(-self.m_pad // self.tiles.wm)

    @property
    def split_n0(self) -> int:
        """The first output column whose K is split: 0 when every tile splits, the start of the
        tail's tile columns otherwise (split-K's workspace holds the columns from it on)."""
        if self.tiles.split == 1:
            return self.n_size
        return (self.tiles_x - self.tiles.tail) * self.tiles.wn if self.tiles.tail else 0

    @property
    def destinations(self) -> tuple[str, ...]:
        """Where the workgroups' sums go: C ("c"), split-K's workspace ("ws"), or (a split tail)
        C from the tiles that sum all of K and the workspace from the tail's."""
        if self.tiles.split == 1:
            return ("c",)
        return ("c", "ws") if self.tiles.tail else ("ws",)

    @property
    def direct_store(self) -> bool:
        """Whether interior tiles store whole accumulator fragments straight to C (row-major)
        instead of element by element through workgroup memory: f32 outputs with contiguous rows at
        least a fragment wide. Dawn wants every buffer a fragment is stored into to hold one
        fragment at least, so outputs sized by the sequence length (which may be shorter than a
        fragment) keep the element-wise path, and so do tiles whose subgroup groups' sums are added
        (MatrixTiles.sg_k). Edges go element by element."""
        fragment = self.frag.m * self.frag.n
        return (self.tiles.sg_k == 1 and self.result is None and not self.also and not self.c.convert and self.c.sn == 1
                and self.c.sm >= self.frag.n
                and SEQ_AXIS not in self.axes[:2] and self.axes[3] != SEQ_AXIS and self.batches * self.m_pad * self.n_size >= fragment)

    @property
    def direct_store_ws(self) -> bool:
        """The same for split-K's f32 workspace [batch, split, M, N - split_n0]."""
        cols = self.n_size - self.split_n0
        return self.tiles.sg_k == 1 and cols >= self.frag.n and self.tiles.split * self.batches * self.m_pad * cols >= self.frag.m * self.frag.n


def epilogue_frags(p: MatrixParams, workgroup_bytes: int) -> int:
    """How many of a subgroup's accumulator fragments along N go out through workgroup memory per
    round (one barrier pair each): a whole row of them where the device's workgroup memory holds it,
    else the largest divisor that fits; one for subgroups of many accumulators (MANY_ACCUMULATORS),
    and where the outputs are stored straight from the fragments (the scratch serves edges only)."""
    direct = {"c": p.direct_store, "ws": p.direct_store_ws}
    if all(direct[d] for d in p.destinations) or p.fm * p.fn > heuristics.MANY_ACCUMULATORS:
        return 1
    per_frag = 4 * p.tiles.subgroups * p.frag.m * p.frag.n
    room = workgroup_bytes - p.tiles.workgroup_bytes(p.frag)
    return max(d for d in range(1, p.fn + 1) if p.fn % d == 0 and (d - 1) * per_frag <= room)


def computed_operand(x, label: str, row_axis: str, k_axis: str, batch_axis: str | None, sizes: dict[str, int],
                     tiles: TileConfig | MatrixTiles, rows: int, split: str | None = None) -> Operand:
    """A prologue operand (ir.partition.is_prologue) of a tile ``rows`` rows high: its element (gr, gk)
    of batch ``batch`` computed by lets in the fetch, reading the tensors it decodes. The SIMT
    template fetches it element by element; the matrix template four elements a fetch along the
    axis its logical layout is contiguous in (``contiguity``; not ``split``, where a grouping starts
    it anywhere), so an invocation decodes neighbours (an NF4 word's, an int8 word's) and stages
    them in one vec4."""
    st = strides(x.shape, sizes)
    vec = None
    vectors = isinstance(tiles, MatrixTiles)
    loads = 0 if vectors else rows * tiles.bk // tiles.threads     # the SIMT fetch's scalar reads a k-step
    if vectors:
        vec = contiguity(Operand(label, "f32", st[row_axis], st[k_axis], st[batch_axis] if batch_axis else 0),
                         row_axis, k_axis, sizes)
        vec = None if vec == split else vec
    index_of = {row_axis: Var("gr"), k_axis: Var("gk")} | ({batch_axis: Var("batch")} if batch_axis else {})
    along = {"k": k_axis, "m": row_axis}.get(vec)
    lets: list[Let] = []
    values = []
    shared: list[tuple] = []     # (IR node, lane 0's name) of the values every lane holds
    for lane in range(4 if vec else 1):
        # the fetch's vec4s start at multiples of 4, so lane j is index | j; what every lane shares
        # (the word an NF4 or int8 weight decodes from, its block's scale) lane 0 computes for all
        at = index_of if lane == 0 else {**index_of, along: Bin("|", index_of[along], Const(lane))}
        lower = Lowerer(sizes, at, prefix=f"pf{lane}_" if vec else "pf")
        bound: dict[int, str] = {}
        for node, name in shared:
            lower.bind(bound, node, name)
        emitted = lower.emit([x], bound)
        if lane == 0 and vec:
            common = shared_lets(emitted, index_of[along].name)
            shared = [(lower.nodes[node_id], name) for node_id, name in bound.items() if name in common]
        lets += emitted
        values.append(lower.ref(x, "f32", bound))
    return Operand(label, "f32", st[row_axis], st[k_axis], st[batch_axis] if batch_axis else 0, vec, loads,
                   tuple(lets), values[0], tuple(values[1:]))


def contiguity(op: Operand, row_axis: str, k: str, sizes: dict[str, int]) -> str | None:
    """Which axis of an operand vec4 reads can run along: "k" when k is contiguous, "m" when the
    rows are, or None. The contiguous axis' size must be a known multiple of 4 (so a vec4 is wholly
    inside or outside the operand), never T (its extent is the real length), and the other strides
    multiples of 4."""
    if op.dtype not in ("f32", "f16") or op.sb % 4:
        return None
    if op.sk == 1 and k != SEQ_AXIS and sizes[k] % 4 == 0 and op.sm % 4 == 0:
        return "k"
    if op.sm == 1 and row_axis != SEQ_AXIS and sizes[row_axis] % 4 == 0 and op.sk % 4 == 0:
        return "m"
    return None


def vector_reads(tiles: TileConfig, op: Operand, row_axis: str, k: str, sizes: dict[str, int],
                 rows: int) -> str | None:
    """The contiguity the SIMT template reads an operand's tile by (see ``contiguity``), where its
    tiles allow: vec4 workgroup tiles, k-steps of whole vec4s, every invocation fetching the same
    number of vec4s. f16 operands are read as vec4<f16>."""
    if not tiles.vec or (rows * tiles.bk // 4) % tiles.threads:
        return None
    mode = contiguity(op, row_axis, k, sizes)
    return None if mode == "k" and tiles.bk % 4 else mode


def _epilogue(exprs, gemm, axes: dict, sizes: dict[str, int]) -> tuple[tuple[Let, ...], list[Value | None]]:
    """The lets that compute each output's epilogue expression (``gemm.epilogue_of`` its root; None
    where it stores the sum itself) from the sum (``dot``) at output element (gm, gn, batch),
    sharing what they have in common, and each output's stored value (None: the sum)."""
    if all(e is None for e in exprs):
        return (), [None] * len(exprs)
    index_of = {axes["m"]: Var("gm"), axes["n"]: Var("gn")} | ({axes["batch"]: Var("batch")} if axes["batch"] else {})
    lower = Lowerer(sizes, index_of, prefix="ep")
    bound: dict[int, str] = {}
    lower.bind(bound, gemm.acc, "dot")
    lets = tuple(lower.emit([e for e in exprs if e is not None], bound))
    return lets, [None if e is None else lower.ref(e, COMPUTE_TYPE[e.dtype], bound) for e in exprs]


def _operands(term, m_axis: str, n_axis: str):
    """(A, B) of a contraction: A is the operand that carries M."""
    a, b = term.srcs[0].srcs
    return (b, a) if n_axis in a.shape else (a, b)


def plan(ir: KernelIR, sizes: dict[str, int], accumulate: frozenset[str], tiles=None, target=None) -> Plan:
    """SIMT tiles, or the matrix units where the target has f16 subgroup matrices and an operand or
    the result is stored as f16 (f32 operands are converted to f16 as they are staged: a result
    stored as f16 keeps no more precision than that; f32 contractions keep f32). A sum of
    contractions runs its terms as phases of one K loop, the longest first (it picks the tiles)."""
    out = ir.outputs[0]
    root = ir.results[out.name]
    gemm = find_contraction(root, out.shape)      # every output is stored from this sum (partition.py)
    terms = sorted(gemm.terms, key=lambda t: -sizes[t.arg])
    axes = gemm_axes(terms[0], out.shape)
    m_axis, n_axis, k, bt = axes["m"], axes["n"], axes["k"], axes["batch"]
    a, b = _operands(terms[0], m_axis, n_axis)
    frag = target.matrix("f16", "f32") if target is not None and target.subgroup_size else None
    matrix = isinstance(tiles, MatrixTiles) or (tiles is None and frag is not None
                                                 and "f16" in (a.dtype, b.dtype, out.dtype))
    if matrix and frag is None:
        raise ValueError(f"{ir.name}: tiles={tiles!r} need a device with f16 subgroup matrices (the matrix units)")
    products = (sizes[bt] if bt else 1) * sizes[m_axis] * sizes[n_axis]
    binding = target.binding_bytes if target is not None else PORTABLE.binding_bytes

    budget = target.storage_buffers if target is not None else PORTABLE.storage_buffers
    tensors = sum(t.name not in ir.inouts for t in ir.inputs) + len(ir.outputs)

    def workspace_problem(t) -> str | None:
        """A split-K workspace is one more binding, of at most the device's binding size (at most:
        the matrix template leaves out the columns its tail covers whole)."""
        if t.split == 1:
            return None
        if tensors + 1 > budget:
            return (f"its split-K workspace would be binding {tensors + 1}; the device allows {budget} "
                    "(max-storage-buffers-per-shader-stage)")
        cols = min(sizes[n_axis], t.tail * t.wn) if getattr(t, "tail", 0) else sizes[n_axis]
        nbytes = t.split * products // sizes[n_axis] * cols * 4
        return f"its split-K workspace of {nbytes} bytes exceeds the device's {binding}-byte binding" if nbytes > binding else None
    given = tiles
    if matrix:
        k_contiguous = sum(strides(x.shape, sizes)[k] == 1 for x in (a, b))
        def problem(t: MatrixTiles) -> str | None:
            return (t.problem(frag, target.subgroup_size, target.workgroup_bytes, sizes[n_axis])
                    or workspace_problem(t))
        tiles = tiles or heuristics.matrix_tiles(sizes[m_axis], sizes[n_axis], sizes[k], k_contiguous,
                                                 lambda t: problem(t) is None)
        if problem(tiles):
            raise ValueError(f"{ir.name}: tiles {tiles} do not fit the matrix template: {problem(tiles)}")
    else:
        if tiles is None:
            tiles = heuristics.matmul_tiles(sizes[m_axis], sizes[n_axis], sizes[k])
            tiles = replace(tiles, split=1) if workspace_problem(tiles) else tiles
        if workspace_problem(tiles):
            raise ValueError(f"{ir.name}: tiles {tiles} do not fit: {workspace_problem(tiles)}")

    def operand(x, row_axis: str, rows: int, kk: str, vectors: bool = True) -> Operand:
        st = strides(x.shape, sizes)
        if x.op != Op.INPUT:
            return _computed(x, row_axis, rows, kk)
        op = Operand(x.arg, x.dtype, st[row_axis], st[kk], st[bt] if bt else 0)
        if matrix:
            return replace(op, vec=contiguity(op, row_axis, kk, sizes) if vectors else None)
        vec = vector_reads(tiles, op, row_axis, kk, sizes, rows) if vectors else None
        return replace(op, vec=vec, loads=rows * tiles.bk // (4 if vec else 1) // tiles.threads)

    def _computed(x, row_axis: str, rows: int, kk: str) -> Operand:
        return computed_operand(x, f"computed {'A' if row_axis == m_axis else 'B'}", row_axis, kk, bt, sizes,
                                tiles, rows)

    rows = (tiles.wm, tiles.wn) if matrix else (tiles.bm, tiles.bn)
    pairs = [_operands(t, m_axis, n_axis) for t in terms]

    def term_reads(scalar: frozenset = frozenset()):
        """Each term's operands; those named in ``scalar`` read element by element."""
        return [(operand(x, m_axis, rows[0], t.arg, x.arg not in scalar),
                 operand(y, n_axis, rows[1], t.arg, y.arg not in scalar)) for t, (x, y) in zip(terms, pairs)]
    modes: dict[str, set] = {}
    for pair in term_reads():
        for op in pair:
            modes.setdefault(op.tensor, set()).add(op.vec)
    # one binding has one element type: a tensor read two ways, or also read by the epilogue (element
    # by element), is read element by element everywhere
    stored = [gemm.epilogue_of(ir.results[o.name]) for o in ir.outputs]      # None: the output is the sum
    by_epilogue = {n.arg for n in toposort([e for e in stored if e is not None], stop={id(gemm.acc)}) if n.op == Op.INPUT}
    # ... and so is a tensor a computed operand reads (its fetch loads elements)
    by_prologue = {n.arg for t in terms for x in t.srcs[0].srcs if x.op != Op.INPUT
                   for n in toposort([x]) if n.op == Op.INPUT}
    reads = term_reads(frozenset(n for n, seen in modes.items() if len(seen) > 1) | by_epilogue | by_prologue)
    if matrix and given is None and target.vec4_staging and all(op.vec for pair in reads for op in pair):
        tiles = replace(tiles, vec4=True)       # LFM2JIT_MATRIX_STAGING=vec4: the default tiles stage vec4s
    ops = reads[0]
    batches = sizes[bt] if bt else 1
    lets, results = _epilogue(stored, gemm, axes, sizes)

    def output(o) -> Output:
        st = strides(o.shape, sizes)
        return Output(o.name, o.dtype, st[m_axis], st[n_axis], st[bt] if bt else 0, o.name in accumulate)
    common = dict(m_ext=extent(m_axis, sizes), n_ext=extent(n_axis, sizes), k_ext=extent(k, sizes), a=ops[0],
                  b=ops[1], c=output(out),
                  axes=(m_axis, n_axis, k, bt), m_pad=sizes[m_axis], n_size=sizes[n_axis], batches=batches,
                  reduce_threads=REDUCE_THREADS,
                  more=tuple(Term(x, y, extent(t.arg, sizes), t.arg) for t, (x, y) in zip(terms[1:], reads[1:])),
                  epilogue=lets, result=results[0],
                  also=tuple((output(o), r) for o, r in zip(ir.outputs[1:], results[1:])))
    if matrix:
        params = MatrixParams(tiles=tiles, frag=frag, subgroup_size=target.subgroup_size, emulated=target.emulated,
                              **common)
        template, params = "matmul_matrix", replace(params, epilogue_frags=epilogue_frags(params, target.workgroup_bytes))
        tile_m, tile_n = tiles.wm, tiles.wn
    else:
        template, params = "matmul", MatmulParams(tiles=tiles, **common)
        tile_m, tile_n = tiles.bm, tiles.bn
    vectors = tuple(dict.fromkeys((op.tensor, 4) for pair in reads for op in pair if op.vec and op.value is None))
    if matrix and tiles.tail:      # one row of workgroups: the whole-K tiles, then the tail's slices
        head = params.tiles_y * (params.tiles_x - tiles.tail)
        grid = (head + tiles.split * tiles.tail * params.tiles_y, 1, batches)
        if grid[0] > MAX_WORKGROUPS:
            raise ValueError(f"{ir.name}: tiles {tiles} need {grid[0]} workgroups in a row, WebGPU allows "
                             f"{MAX_WORKGROUPS}: take a shorter tail or a smaller split")
    else:
        grid = (-(-sizes[n_axis] // tile_n), -(-sizes[m_axis] // tile_m), batches * tiles.split)
    if tiles.split == 1:
        return Plan(template, params, (EntryPoint("main", grid),), vectors=vectors)
    # pass 1 writes each K slice's partial tile to a workspace [batch, split, M, N - split_n0]; pass 2
    # ("reduce", one invocation per workspace column of each row) sums the slices into the output
    elements = batches * sizes[m_axis] * (sizes[n_axis] - params.split_n0)
    return Plan(template, params, (EntryPoint("main", grid), EntryPoint("reduce", -(-elements // REDUCE_THREADS))),
                (Scratch("ws", "f32", tiles.split * elements),), vectors)
