"""Case files: a kernel's source with a comment header holding everything needed to replay it.

    # lfm2jit fuzz case
    # sizes: T=5 D=3
    # bucket: 4
    # data-seed: 17
    # left-out: b s0        (defaulted inputs the call leaves out; optional line)
    # dropped: B            (optional leading axes the call leaves out; optional line)
    # poison: on            (T-leading tensors with NaN padded rows; optional line)
    # seed: 42
    # forward: wrong: output y0: max error ...
    # backward: ok
    kernel k(...) -> (...) { ... }

Only sizes, bucket, data-seed, left-out, dropped and poison are read back (the rest records what was seen); the kernel is
parsed with the fuzzer's own parser, so its meaning does not depend on the compiler.
"""
from __future__ import annotations

from pathlib import Path

from .expr import kernel_text, parse
from .generate import Case

HEADER = "# lfm2jit fuzz case"


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + " ..."


def case_text(case: Case, result=None, note: str = "") -> str:
    lines = [HEADER]
    if note or case.note:
        lines.append(f"# note: {_one_line(note or case.note)}")
    lines.append("# sizes: " + (" ".join(f"{a}={n}" for a, n in case.sizes.items()) or "-"))
    lines.append(f"# bucket: {case.bucket}")
    lines.append(f"# data-seed: {case.data_seed}")
    if case.left_out:
        lines.append("# left-out: " + " ".join(case.left_out))
    if case.dropped:
        lines.append("# dropped: " + " ".join(case.dropped))
    if case.poison:
        lines.append("# poison: on")
    if case.seed is not None:
        lines.append(f"# seed: {case.seed}")
    if result is not None:
        for side, o in (("forward", result.forward), ("backward", result.backward)):
            lines.append(f"# {side}: " + _one_line(o.summary() if o.cls != "ok" else "ok"))
        for side, o in (("forward", result.forward), ("backward", result.backward)):
            if o.cls in ("invalid_wgsl", "unlocated", "foreign"):    # the whole message, without the WGSL
                lines.append(f"# {side} error in full:")
                lines += [f"#   {l}" for l in o.detail.split("--- WGSL ---")[0].rstrip().splitlines()]
    return "\n".join(lines) + "\n" + kernel_text(case.kernel)


def write_case(path: Path, case: Case, result=None, note: str = "") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(case_text(case, result, note))
    return path


def load_case(path: Path) -> Case:
    text = Path(path).read_text()
    return case_from_text(text, str(path))


def case_from_text(text: str, origin: str = "<case>") -> Case:
    sizes, bucket, data_seed, seed, note = {}, 4, 0, None, ""
    left_out, dropped, poison = (), (), False
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        key, _, value = line[1:].strip().partition(":")
        value = value.strip()
        if key == "sizes" and value != "-":
            sizes = {a: int(n) for a, n in (item.split("=") for item in value.split())}
        elif key == "bucket":
            bucket = int(value)
        elif key == "data-seed":
            data_seed = int(value)
        elif key == "seed":
            seed = int(value)
        elif key == "note":
            note = value
        elif key == "left-out":
            left_out = tuple(value.split())
        elif key == "dropped":
            dropped = tuple(value.split())
        elif key == "poison":
            poison = value.lower() in ("on", "yes", "1", "true")
    kernels = parse(text)
    if len(kernels) != 1:
        raise ValueError(f"{origin}: a case file holds one kernel, found {len(kernels)}")
    k = kernels[0]
    missing = [a for a in k.axes() if not a.isdigit() and a not in sizes]
    if missing:
        raise ValueError(f"{origin}: no size for axes {missing} (a '# sizes: T=5 D=3' line)")
    defaulted = {p.name for p in k.inputs if p.default is not None}
    if set(left_out) - defaulted:
        raise ValueError(f"{origin}: left-out inputs {sorted(set(left_out) - defaulted)} have no default")
    return Case(k, {a: sizes[a] for a in k.axes() if not a.isdigit()}, bucket, seed, data_seed, note,
                left_out=left_out, dropped=dropped, poison=poison)


def corpus_dir() -> Path:
    return Path(__file__).resolve().parent / "cases"


def corpus() -> list[Path]:
    return sorted(corpus_dir().glob("*.lk"))
