"""Catch `torchrun ... python train_distillation.py`, a launch that never reaches the trainer.

torchrun runs its first positional argument as the script, with the interpreter in front of it:
`torchrun --nproc_per_node=2 python train_distillation.py` executes `python -u python
train_distillation.py`, so Python looks for a FILE named `python` in the working directory. The
repository root ships files named `python` and `python3` that call `explain()`: every rank then
prints the corrected command instead of "can't open file .../python", and torchrun's summary shows
the same text as the root cause.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from distill.ops.errors import DistillError, Stage, report


def corrected_command(interpreter_name: str, argv: list[str]) -> str:
    """The torchrun command the user meant: the same arguments without the interpreter name."""
    nproc = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "N"
    nnodes = int(os.environ.get("WORLD_SIZE", "1")) // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    nodes = f" --nnodes={nnodes}" if nnodes > 1 else ""
    return f"torchrun{nodes} --nproc_per_node={nproc} " + shlex.join(argv or ["train_distillation.py", "..."])


def launch_error(interpreter_name: str, argv: list[str]) -> DistillError:
    """The explanation of an interpreter name given to torchrun as if it were the script."""
    script = argv[0] if argv else "train_distillation.py"
    under_torchrun = (
        os.environ.get("TORCHELASTIC_RUN_ID") is not None or os.environ.get("LOCAL_RANK") is not None
    )
    launcher = "torchrun" if under_torchrun else "the launcher"
    return DistillError(
        f"{launcher} was given '{interpreter_name}' as the script to run, so {script} never started",
        f"torchrun runs its first argument with Python itself: '{interpreter_name} {script}' made it execute "
        f"'python -u {interpreter_name} {script}', i.e. a file named '{interpreter_name}' in this folder.",
        causes=[f"the word '{interpreter_name}' between torchrun's flags and the script name"],
        fixes=[
            "drop it; torchrun already runs the script with Python:\n       "
            + corrected_command(interpreter_name, argv),
            "or, to name the interpreter explicitly: "
            f"{interpreter_name} -m torch.distributed.run --nproc_per_node=N {script} ...",
        ],
        stage=Stage.ARGV,
    )


def explain(interpreter_name: str, argv: list[str]) -> int:
    """Report the mistake (banner on stderr + torchrun error file) and return the ARGV exit code,
    once every rank of this node has reported it too."""
    code = report(launch_error(interpreter_name, argv))
    wait_for_local_ranks()
    return code


def wait_for_local_ranks(timeout: float = 30.0) -> None:
    """Under torchrun, return once every rank of this node has reached this point (or `timeout`).

    torchrun stops the other ranks as soon as one exits with an error: on a busy machine a rank still
    starting would be killed before it printed, and the same mistake would give one banner or two.
    Each rank leaves a mark in a folder of this launch (its run id and restart) and waits for all
    LOCAL_WORLD_SIZE marks. The first rank to see them all removes the folder (the others then find
    it gone and leave too): not rank 0 alone, which torchrun may stop before it gets there, as soon as
    another rank has reported and exited."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if run_id is None or ranks <= 1:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    marks = Path(tempfile.gettempdir()) / f"distill-launch-{run_id}-{attempt}"
    local_rank = os.environ.get("LOCAL_RANK", "0")
    try:
        marks.mkdir(exist_ok=True)
        (marks / local_rank).touch()
    except OSError:
        return  # nowhere to meet: report alone rather than not at all
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(os.listdir(marks)) >= ranks:
                break
        except FileNotFoundError:  # another rank saw every mark and cleared the folder
            return
        time.sleep(0.05)
    shutil.rmtree(marks, ignore_errors=True)
