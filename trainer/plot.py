"""A loss-curve PNG with nothing but numpy, zlib and struct (no plotting library).

``plot_loss_curve(path, steps, losses, ...)`` draws the per-step training loss (light), its
moving average (dark), optional held-out evaluation points (red squares), axes with "nice" tick
values and labels in a built-in 5x7 pixel font, and writes an 8-bit RGB PNG. ``write_png`` and
``read_png`` are the raw encoder and a minimal decoder (for tests: 8-bit RGB, filter types 0-4).
"""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["plot_loss_curve", "write_png", "read_png", "nice_ticks"]

# ---------------------------------------------------------------------------------------------
# PNG in and out
# ---------------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path, rgb: np.ndarray) -> Path:
    """Write an ``[H, W, 3]`` uint8 image as an 8-bit RGB PNG (filter 0 on every row)."""
    img = np.ascontiguousarray(rgb, dtype=np.uint8)
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise ValueError(f"expected an [H, W, 3] image, got shape {list(img.shape)}")
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1).tobytes()
    data = (PNG_SIGNATURE
            + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def read_png(path) -> np.ndarray:
    """Decode an 8-bit RGB, non-interlaced PNG into ``[H, W, 3]`` uint8 (checks every CRC)."""
    data = Path(path).read_bytes()
    if data[:8] != PNG_SIGNATURE:
        raise ValueError(f"{path}: not a PNG (bad signature)")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad CRC in chunk {kind!r}")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + n
    if header is None:
        raise ValueError(f"{path}: no IHDR chunk")
    w, h, depth, color, _, _, interlace = header
    if (depth, color, interlace) != (8, 2, 0):
        raise ValueError(f"{path}: only 8-bit RGB non-interlaced PNGs are supported, got {header}")
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * 3)
    out = np.zeros((h, w * 3), np.int32)
    prev = np.zeros(w * 3, np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f in (0, 2):                     # no dependence within the row: vectorised
            out[y] = prev = (line + (prev if f == 2 else 0)) & 0xFF
            continue
        cur = np.zeros(w * 3, np.int32)
        for x in range(w * 3):
            a = cur[x - 3] if x >= 3 else 0
            b = prev[x]
            c = prev[x - 3] if x >= 3 else 0
            if f == 0:
                pred = 0
            elif f == 1:
                pred = a
            elif f == 2:
                pred = b
            elif f == 3:
                pred = (a + b) // 2
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            else:
                raise ValueError(f"{path}: unknown filter type {f} on row {y}")
            cur[x] = (line[x] + pred) & 0xFF
        out[y] = prev = cur
    return out.reshape(h, w, 3).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# a 5x7 pixel font (the characters tick labels and titles need)
# ---------------------------------------------------------------------------------------------

_GLYPHS = {
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
    ".": ["00000", "00000", "00000", "00000", "00000", "01100", "01100"],
    ",": ["00000", "00000", "00000", "00000", "01100", "00100", "01000"],
    "-": ["00000", "00000", "00000", "11111", "00000", "00000", "00000"],
    "+": ["00000", "00100", "00100", "11111", "00100", "00100", "00000"],
    ":": ["00000", "01100", "01100", "00000", "01100", "01100", "00000"],
    "(": ["00010", "00100", "01000", "01000", "01000", "00100", "00010"],
    ")": ["01000", "00100", "00010", "00010", "00010", "00100", "01000"],
    "/": ["00000", "00001", "00010", "00100", "01000", "10000", "00000"],
    "=": ["00000", "00000", "11111", "00000", "11111", "00000", "00000"],
    " ": ["00000"] * 7,
    "a": ["00000", "00000", "01110", "00001", "01111", "10001", "01111"],
    "b": ["10000", "10000", "10110", "11001", "10001", "10001", "11110"],
    "c": ["00000", "00000", "01110", "10000", "10000", "10001", "01110"],
    "d": ["00001", "00001", "01101", "10011", "10001", "10001", "01111"],
    "e": ["00000", "00000", "01110", "10001", "11111", "10000", "01110"],
    "f": ["00110", "01001", "01000", "11100", "01000", "01000", "01000"],
    "g": ["00000", "00000", "01111", "10001", "10001", "01111", "00001", "01110"],
    "h": ["10000", "10000", "10110", "11001", "10001", "10001", "10001"],
    "i": ["00100", "00000", "01100", "00100", "00100", "00100", "01110"],
    "k": ["10000", "10000", "10010", "10100", "11000", "10100", "10010"],
    "l": ["01100", "00100", "00100", "00100", "00100", "00100", "01110"],
    "m": ["00000", "00000", "11010", "10101", "10101", "10001", "10001"],
    "n": ["00000", "00000", "10110", "11001", "10001", "10001", "10001"],
    "o": ["00000", "00000", "01110", "10001", "10001", "10001", "01110"],
    "p": ["00000", "00000", "11110", "10001", "10001", "11110", "10000", "10000"],
    "r": ["00000", "00000", "10110", "11001", "10000", "10000", "10000"],
    "s": ["00000", "00000", "01110", "10000", "01110", "00001", "11110"],
    "t": ["01000", "01000", "11100", "01000", "01000", "01001", "00110"],
    "u": ["00000", "00000", "10001", "10001", "10001", "10011", "01101"],
    "v": ["00000", "00000", "10001", "10001", "10001", "01010", "00100"],
    "w": ["00000", "00000", "10001", "10001", "10101", "10101", "01010"],
    "x": ["00000", "00000", "10001", "01010", "00100", "01010", "10001"],
    "y": ["00000", "00000", "10001", "10001", "10001", "01111", "00001", "01110"],
    "z": ["00000", "00000", "11111", "00010", "00100", "01000", "11111"],
    "j": ["00010", "00000", "00110", "00010", "00010", "00010", "10010", "01100"],
    "q": ["00000", "00000", "01111", "10001", "10001", "01111", "00001", "00001"],
    "%": ["11000", "11001", "00010", "00100", "01000", "10011", "00011"],
}
# 7 rows above the baseline, an 8th for descenders (g, j, p, q, y)
_FONT = {c: np.array([[ch == "1" for ch in row] for row in (rows + ["00000"])[:8]], bool) for c, rows in _GLYPHS.items()}
GLYPH_W, GLYPH_H, ADVANCE = 5, 7, 6


def text_width(text: str, scale: int = 1) -> int:
    return max(0, len(text) * ADVANCE - 1) * scale


def _draw_text(img: np.ndarray, x: int, y: int, text: str, color, scale: int = 1) -> None:
    """Draw ``text`` with its top-left corner at (x, y); unknown characters are drawn as blanks."""
    h, w, _ = img.shape
    for i, ch in enumerate(text):
        glyph = _FONT.get(ch, _FONT.get(ch.lower(), _FONT[" "]))
        if scale > 1:
            glyph = np.kron(glyph, np.ones((scale, scale), bool))
        gx, gy = x + i * ADVANCE * scale, y
        ys, xs = np.nonzero(glyph)
        ys, xs = ys + gy, xs + gx
        ok = (ys >= 0) & (ys < h) & (xs >= 0) & (xs < w)
        img[ys[ok], xs[ok]] = color


# ---------------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------------

def nice_ticks(lo: float, hi: float, count: int = 5, min_step: float = 0.0) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten, at least ``min_step`` apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) if lo else 1.0)
    raw = max((hi - lo) / max(1, count), min_step)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _fmt(v: float, step: float) -> str:
    if step >= 1 - 1e-9 and abs(v) < 1e6:
        return str(int(round(v)))
    step = float(f"{step:.6g}")
    decimals = min(6, max(0, -int(math.floor(math.log10(step))) + (1 if f"{step:g}".endswith("5") else 0)))
    return f"{v:.{decimals}f}"


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
    h, w, _ = img.shape
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.linspace(x0, x1, n + 1)
    ys = np.linspace(y0, y1, n + 1)
    for dx in range(-(width // 2), width - width // 2):
        for dy in range(-(width // 2), width - width // 2):
            xi = np.round(xs).astype(int) + dx
            yi = np.round(ys).astype(int) + dy
            ok = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
            img[yi[ok], xi[ok]] = color


def _polyline(img, xs, ys, color, width=1) -> None:
    for i in range(len(xs) - 1):
        _line(img, xs[i], ys[i], xs[i + 1], ys[i + 1], color, width)
    if len(xs) == 1:
        _line(img, xs[0] - 1, ys[0], xs[0] + 1, ys[0], color, width + 1)


def moving_average(values, window: int) -> np.ndarray:
    """Centred mean over ``window`` values (fewer near the ends), so the curve does not lag."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(v.size)
    lo = np.maximum(0, idx - window // 2)
    hi = np.minimum(v.size, idx + (window - window // 2))
    return (c[hi] - c[lo]) / (hi - lo)


def plot_loss_curve(path, steps, losses, *, evals: list[tuple[float, float]] | None = None,
                    title: str = "training loss", width: int = 720, height: int = 440) -> Path:
    """Draw loss against optimizer step and write it as a PNG.

    ``steps``/``losses``: one point per optimizer step (non-finite losses are left out).
    ``evals``: ``(step, loss)`` points of held-out evaluations, drawn as red squares.
    """
    steps = np.asarray(steps, np.float64)
    losses = np.asarray(losses, np.float64)
    ok = np.isfinite(steps) & np.isfinite(losses)
    steps, losses = steps[ok], losses[ok]
    evals = [(float(s), float(v)) for s, v in (evals or []) if math.isfinite(s) and math.isfinite(v)]
    bg, axis_c, grid_c = (255, 255, 255), (40, 40, 40), (228, 228, 228)
    raw_c, avg_c, eval_c = (160, 190, 235), (20, 70, 170), (210, 40, 40)
    img = np.full((height, width, 3), bg, np.uint8)
    left, right, top, bottom = 70, 20, 34, 48
    pw, ph = width - left - right, height - top - bottom
    _draw_text(img, left, 10, title, axis_c, scale=2)

    all_x = np.concatenate([steps, [s for s, _ in evals]]) if evals else steps
    all_y = np.concatenate([losses, [v for _, v in evals]]) if evals else losses
    if all_x.size == 0:
        _draw_text(img, left + 10, top + ph // 2, "no finite losses to plot", axis_c)
        return write_png(path, img)
    x_lo, x_hi = float(all_x.min()), float(all_x.max())
    if x_hi <= x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = float(all_y.min()), float(all_y.max())
    pad = (y_hi - y_lo) * 0.05 or max(abs(y_hi) * 0.05, 0.05)
    y_lo, y_hi = max(0.0, y_lo - pad) if y_lo >= 0 else y_lo - pad, y_hi + pad
    xt, yt = nice_ticks(x_lo, x_hi, 6, min_step=1.0), nice_ticks(y_lo, y_hi, 6)
    if xt:
        x_lo, x_hi = min(x_lo, xt[0]), max(x_hi, xt[-1])
    if yt:
        y_lo, y_hi = min(y_lo, yt[0]), max(y_hi, yt[-1])

    def px(x):
        return left + (np.asarray(x) - x_lo) / (x_hi - x_lo) * (pw - 1)

    def py(y):
        return top + (1 - (np.asarray(y) - y_lo) / (y_hi - y_lo)) * (ph - 1)

    x_step = xt[1] - xt[0] if len(xt) > 1 else 1.0
    y_step = yt[1] - yt[0] if len(yt) > 1 else 1.0
    for t in xt:
        x = int(round(float(px(t))))
        img[top:top + ph, x] = grid_c
        img[top + ph:top + ph + 5, x] = axis_c
        label = _fmt(t, x_step)
        _draw_text(img, x - text_width(label) // 2, top + ph + 8, label, axis_c)
    for t in yt:
        y = int(round(float(py(t))))
        img[y, left:left + pw] = grid_c
        img[y, left - 5:left] = axis_c
        label = _fmt(t, y_step)
        _draw_text(img, left - 8 - text_width(label), y - GLYPH_H // 2, label, axis_c)
    img[top:top + ph, left] = axis_c
    img[top + ph - 1, left:left + pw] = axis_c
    _draw_text(img, left + pw // 2 - text_width("optimizer step") // 2, height - 16, "optimizer step", axis_c)
    _draw_text(img, 6, top - 12, "loss", axis_c)

    if steps.size:
        _polyline(img, px(steps), py(losses), raw_c)
        if steps.size <= 60:                      # few steps: mark each one
            for x, y in zip(px(steps), py(losses)):
                x, y = int(round(float(x))), int(round(float(y)))
                img[max(0, y - 2):y + 3, max(0, x - 2):x + 3] = raw_c
        window = max(1, steps.size // 25)
        if window > 1:
            _polyline(img, px(steps), py(moving_average(losses, window)), avg_c, width=2)
    for s, v in evals:
        x, y = int(round(float(px(s)))), int(round(float(py(v))))
        img[max(0, y - 3):y + 4, max(0, x - 3):x + 4] = eval_c
    # legend
    lx, ly = left + pw - 190, top + 8
    img[ly + 3, lx:lx + 16] = raw_c
    _draw_text(img, lx + 22, ly, "loss per step", axis_c)
    if steps.size // 25 > 1:
        ly += 12
        img[ly + 3:ly + 5, lx:lx + 16] = avg_c
        _draw_text(img, lx + 22, ly, f"mean of {steps.size // 25} steps", axis_c)
    if evals:
        ly += 12
        img[ly + 1:ly + 7, lx + 5:lx + 11] = eval_c
        _draw_text(img, lx + 22, ly, "held-out eval", axis_c)
    return write_png(path, img)
