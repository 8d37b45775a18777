"""torchrun for the suite's multi-rank runs that check what training computes, with its ranks forked
from a process that has already imported the trainer.

    python tests/warm_torchrun.py --standalone --nproc_per_node=2 SCRIPT ARGS...

The launcher is torch.distributed.run itself (its arguments, rendezvous, agent and failure summary);
only the way a rank starts differs. A rank of the real torchrun is a new interpreter that imports
torch, diffusers, peft and transformers again before its first step: about 5 CPU seconds a rank, most
of what a tiny two-rank run costs and, over the suite's launches, minutes of a suite that runs on two
cores. Here the imports happen once, in this process; each rank is forked from it (torchrun's
`--run-path --start-method fork`) and calls the script's `main()` with sys.argv set as the script
would see it (SCRIPT: train_distillation.py or one of tests/*_check.py).

The runs that check failures (distill/stress.py, test_error_handling.py, tests/test_resilience.py)
keep the real torchrun: what they hold is what a user's own launch prints, exit codes and signals
included.
"""

from __future__ import annotations

import runpy
import sys

from torch.distributed import run as torchrun

# What a rank imports (torch, diffusers, peft, transformers), once, before the ranks are forked.
import distill.train.diagnose  # noqa: F401
import distill.train.trainer  # noqa: F401
import train_distillation  # noqa: F401


def rank_main(script: str, *args: str) -> None:
    """One rank: the script's main(), its exit code raised as SystemExit when it is not 0. A rank must
    return rather than leave through os._exit (as train_distillation.py's own `__main__` does under
    torchrun): the agent of function ranks counts a rank as done when its return value arrives."""
    sys.argv = [script, *args]
    namespace = runpy.run_path(script, run_name="__rank__")  # defines; its __main__ block does not run
    code = namespace["main"]()
    if code:
        raise SystemExit(code)


def main(argv: list[str]) -> None:
    # torchrun's --run-path calls this module's run_script_path(script, *args) in each rank
    torchrun.run_script_path = rank_main
    torchrun.main(["--run-path", "--start-method", "fork", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
