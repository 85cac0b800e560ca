"""Differential fuzzing of the compiler: random well-typed kernels, each with its own float64
meaning, run through the public API (compile_source, grad, ComputeEngine) and classified.

    expr.py      the fuzzer's own model of the language: tree, type rules, printer, parser, evaluator
    generate.py  random kernels (Generator, generate(seed))
    run.py       Runner: forward and backward verdicts (ok / wrong / invalid_wgsl / refused /
                 unlocated / foreign, and skipped / n/a), with the precision model
    shrink.py    greedy delta debugging of a failing case
    corpus.py    case files (.lk with a header) and the regression corpus in cases/
    cli.py       ``python -m tests.fuzz N``

Nothing here imports the compiler's IR; only the public API is used.
"""
from .corpus import case_from_text, corpus, load_case, write_case
from .generate import Case, generate
from .run import CLASSES, FAILING, Outcome, Result, Runner

__all__ = ["CLASSES", "FAILING", "Case", "Outcome", "Result", "Runner", "case_from_text", "corpus", "generate",
           "load_case", "write_case"]
