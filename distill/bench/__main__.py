"""`python -m distill.bench`: the step benchmark (its settings and output: distill/bench/cli.py)."""

import sys

from distill.bench.cli import main

main(sys.argv[1:])
