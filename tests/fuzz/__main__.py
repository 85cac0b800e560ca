"""``python -m tests.fuzz N [--seed S]`` from a checkout: the differential fuzzer's command line."""
import argparse
import sys

from .cli import add_arguments, fuzz_main

parser = argparse.ArgumentParser(
    prog="python -m tests.fuzz",
    description="Generate N random kernels, run each (and its backward) on the engine, compare with the fuzzer's "
                "own float64 meaning, count the outcome classes and write every failing case "
                "(wrong/invalid_wgsl/unlocated/foreign) as a .lk file. Exit status 1 if any case fails.")
add_arguments(parser)
sys.exit(fuzz_main(parser.parse_args()))
