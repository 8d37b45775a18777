"""`python -m distill.bench`: the step benchmark (its settings and output: distill/bench/cli.py)."""

import sys

from distill.bench.cli import main

result = main(sys.argv[1:])
sys.exit(result if isinstance(result, int) else 0)  # a refusal returns its exit code
