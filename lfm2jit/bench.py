"""``python -m lfm2jit.bench``: the benchmark suite, which lives in the checkout's benches/bench.py.

It times kernels and whole train steps (it needs the trainer), so it is not part of the compiler
package; this entry point runs it from a source checkout.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benches" / "bench.py"


def main() -> None:
    if not BENCH.exists():
        sys.exit(f"python -m lfm2jit.bench: benches/bench.py is not here ({BENCH}); the benchmarks ship with "
                 "the source checkout (git clone, then pip install -e .)")
    sys.argv[0] = str(BENCH)
    runpy.run_path(str(BENCH), run_name="__main__")


if __name__ == "__main__":
    main()
