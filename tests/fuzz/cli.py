"""``python -m tests.fuzz N``: generate N kernels, run them, count the classes, keep the failures."""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

from .corpus import load_case, write_case
from .expr import ModelError
from .generate import FEATURES, features, generate
from .run import CLASSES, FAILING, Result, Runner

SIDES = ("forward", "backward")


def case_seed(seed: int, i: int) -> int:
    """The generator seed of case i of a run with --seed seed (independent streams per run)."""
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0] & 0x7FFFFFFF)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("n", type=int, metavar="N", help="how many kernels to generate and run")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="run seed (default 0); case i uses "
                   "generator seed case_seed(S, i), written in each case file")
    p.add_argument("--no-backward", action="store_true", help="check only the forward kernels")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="where failing cases are written (default: a fresh fuzz-failures/<date>-<time>/)")
    p.add_argument("--shrink", action="store_true", help="minimise each failing case before writing it")
    p.add_argument("--replay", type=Path, action="append", default=[], metavar="PATH",
                   help="run these case files (or directories of *.lk) instead of generating; N is ignored")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def counts_table(results: list[Result]) -> str:
    counts = {side: collections.Counter(getattr(r, side).cls for r in results) for side in SIDES}
    rows = [f"{'class':<14}{'forward':>9}{'backward':>10}"]
    for cls in CLASSES:
        f, b = counts["forward"][cls], counts["backward"][cls]
        if cls == "n/a" and not f and not b:
            continue
        rows.append(f"{cls:<14}{f:>9}{b:>10}")
    rows.append(f"{'total':<14}{len(results):>9}{len(results):>10}")
    return "\n".join(rows)


def features_table(results: list[Result]) -> str:
    """Per feature of the language (windows, defaults, optional axes, poison...): how many kernels
    use it and how many of those fail, forward and backward."""
    rows = [f"{'feature':<14}{'kernels':>9}{'fwd fail':>10}{'bwd fail':>10}"]
    for name in FEATURES:
        rs = [r for r in results if name in features(r.case)]
        rows.append(f"{name:<14}{len(rs):>9}{sum(r.forward.failing for r in rs):>10}"
                    f"{sum(r.backward.failing for r in rs):>10}")
    return "\n".join(rows)


def causes_table(results: list[Result], classes=FAILING) -> str:
    """One line per distinct cause among outcomes of ``classes``, with its count and the first case."""
    seen: dict[tuple, list] = {}
    for r in results:
        for side in SIDES:
            o = getattr(r, side)
            if o.cls in classes:
                key = (side, o.cause())
                seen.setdefault(key, []).append(r)
    lines = []
    for (side, cause), rs in sorted(seen.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"{len(rs):>5}  {side:<8}  {cause}   (e.g. seed {rs[0].case.seed})")
    return "\n".join(lines)


def fuzz_main(args) -> int:
    start = time.time()
    runner = Runner(backward=not args.no_backward)
    if args.replay:
        paths = []
        for p in args.replay:
            paths += sorted(Path(p).glob("*.lk")) if Path(p).is_dir() else [Path(p)]
        cases = ((str(p), load_case(p)) for p in paths)
        total = len(paths)
    else:
        cases = ((str(i), generate(case_seed(args.seed, i), runner.has_f16)) for i in range(args.n))
        total = args.n
    out_dir = args.out
    if out_dir is None:
        out_dir = Path("fuzz-failures") / time.strftime("%Y%m%d-%H%M%S")
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="kernel", file=sys.stderr, dynamic_ncols=True)
    results: list[Result] = []
    written = 0
    for label, case in cases:
        try:
            r = runner.run(case)
        except ModelError as e:      # a replayed file the fuzzer's own rules reject: nothing to compare with
            print(f"{label}: not run, the fuzzer's model rejects it: {e}", file=sys.stderr)
            continue
        results.append(r)
        if r.failing:
            if args.shrink:
                from .shrink import failure_of, same_failure, shrink
                side, cls, cause = failure_of(r)
                small = shrink(case, runner, same_failure(side, cls, cause))
                r = runner.run(small)
                case = small
            stem = Path(label).stem if args.replay else f"{int(label):05d}"
            name = f"{stem}-{r.forward.cls}-{r.backward.cls}".replace("/", "")     # n/a -> na
            write_case(out_dir / f"{name}.lk", case, r)
            written += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(failing=sum(x.failing for x in results), refresh=False)
    if bar is not None:
        bar.close()
    print(f"{len(results)} kernels in {time.time() - start:.1f}s on {runner.ctx.name} "
          f"(seed {args.seed}{', forward only' if args.no_backward else ''})")
    print(counts_table(results))
    print(features_table(results))
    refused = sum(r.forward.cls == "refused" for r in results)
    print(f"refused share (forward): {refused / max(len(results), 1):.1%}")
    causes = causes_table(results)
    if causes:
        print("\nfailures by cause:")
        print(causes)
    refusals = causes_table(results, ("refused",))
    if refusals:
        print("\nrefusals by cause (located DslErrors: not failures, but limitations to know):")
        print(refusals)
    if written:
        print(f"\n{written} failing case{'s' * (written != 1)} written to {out_dir}/")
    return 1 if any(r.failing for r in results) else 0
