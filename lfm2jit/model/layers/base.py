"""What every layer shares: the rows a pass runs over, and the pre-norm residual shape
h + out(body(rmsnorm(h))) with what it saves for backward."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...runtime import Tensor
from .kernels import Kernels, LoraSaved


@dataclass(frozen=True)
class Rows:
    """A pass's T rows: one sequence, or ``batch`` packed sequences of ``seq`` rows each. Every
    kernel but the conv and attention works row by row, over all T rows in ``bucket``."""
    bucket: int
    batch: int = 1
    seq: int = 0
    ids: Tensor | None = field(default=None, compare=False)   # (T,) i32 the rows' tokens, where known
    # sequences concatenated in the one row (batch 1): the conv and attention keep within each
    segments: object = field(default=None, compare=False)      # model/ids.Segments

    @property
    def seq_bucket(self) -> int:
        """The bucket of the kernels that mix positions: packed sequences are S rows apart, so
        each is a whole bucket of S."""
        return self.bucket if self.batch == 1 else self.seq

    def by_sequence(self, x: Tensor) -> Tensor:
        """x (T, ...) as the conv and attention kernels take it: (B, S, ...) when sequences are packed."""
        return x if self.batch == 1 else x.view(self.batch, self.seq, *x.shape[1:])


@dataclass
class ResidualSaved:
    """What every residual layer keeps: its input, its norm's statistics, its adapters' activations."""
    h: Tensor                       # (T, D) the layer's input, also the residual added to its output
    inv: Tensor                     # (T,) its rmsnorm's 1/rms
    lora: LoraSaved                 # its LoRA-adapted linears' low-rank activations


class Residual:
    """A layer h + out(body(xn)), xn = rmsnorm(h) with weight ``norm``. A subclass gives
    ``forward(h, rows, train) -> (output, saved)``, ``recompute(saved, rows)`` (puts back what
    forward did not keep) and ``backward(saved, dh, rows)`` (dh: the output's gradient, to which
    it adds the gradient through the body, making it the input's)."""
    norm: str                       # the rmsnorm's weight
    out: str                        # the output projection, which adds the residual in its epilogue

    def __init__(self, kernels: Kernels, cfg, index: int):
        self.kernels, self.cfg, self.pre = kernels, cfg, f"model.layers.{index}."

    def normed(self, h: Tensor, bucket: int) -> tuple[Tensor, Tensor]:
        """xn = rmsnorm(h) (T, D) and its 1/rms (T,)."""
        return self.kernels.norm(h, self.pre + self.norm, bucket)

    def project(self, y: Tensor, h: Tensor, bucket: int, lora: LoraSaved | None = None) -> Tensor:
        """h + out(y) (T, D)."""
        return self.kernels.linear(y, self.pre + self.out, bucket, lora=lora, residual=h)

    def norm_backward(self, s: ResidualSaved, dxn: Tensor, dh: Tensor, bucket: int) -> None:
        """xn = rmsnorm(h): its gradient in h added into dh, which already holds the residual's."""
        self.kernels.norm_backward(s.h, s.inv, self.pre + self.norm, dxn, bucket, into=dh)
