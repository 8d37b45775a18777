"""What the project offers, one line per command.

    python -m distill              # the list below
    python -m distill evaluate ... # the same as python -m distill.evaluate ...

Training and downloading are scripts at the top of the repository (torchrun takes a script, not a
module), so `python -m distill train` and `download` run those scripts with the arguments given.
"""

from __future__ import annotations

import difflib
import runpy
import sys
from pathlib import Path

from distill.ops.command import entry_point
from distill.ops.errors import DistillError, Stage

REPO = Path(__file__).resolve().parents[1]

# name -> (how to run it, what it does). Scripts end in .py; the rest are modules.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "train_distillation.py",
        "distil the teacher into a student or a LoRA of its experts (velocity, dmd, ode_init, "
        "self_forcing); torchrun for several GPUs",
    ),
    "generate": (
        "distill.generate",
        "images or videos from a student (or the teacher), via WanPipeline; --stream: a causal one",
    ),
    "evaluate": (
        "distill.evaluate",
        "student vs teacher: eval.json and eval.png (toy world: its scores)",
    ),
    "bench": ("distill.bench", "time the training step against a bare loop: phases, memory, MFU"),
    "gpu-check": (
        "distill.gpu_check",
        "on a CUDA machine: gpu tests, NCCL, the benchmarks at 1 and 81 frames, the streamed teacher "
        "(make gpu-check)",
    ),
    "doctor": (
        "distill.doctor",
        "check the machine before a long run: CUDA, NCCL, ranks, the teacher",
    ),
    "stress": ("distill.stress", "rehearse failures (signals, dead workers, hangs), check every banner"),
    "download": (
        "download_wan.py",
        "download, verify or convert the teacher; write the tiny or toy teacher",
    ),
    "demo": ("distill.demo", "the end of `make demo`: a table and summary.png from eval.json"),
}


def how_to_run(target: str) -> str:
    return f"python {target}" if target.endswith(".py") else f"python -m {target}"


def usage() -> str:
    """One line per command: its name, how to run it on its own, what it does."""
    name_width = max(len(name) for name in COMMANDS)
    how_width = max(len(how_to_run(target)) for target, _ in COMMANDS.values())
    lines = ["usage: python -m distill COMMAND [ARGS...]   (or run a command on its own; add --help)", ""]
    for name, (target, what) in COMMANDS.items():
        lines.append(f"  {name:<{name_width}}  {how_to_run(target):<{how_width}}  {what}")
    lines += ["", "first steps: make demo (the toy teacher, ~3 min on 2 cores), make test"]
    return "\n".join(lines)


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        raise DistillError(
            f"unknown command {name!r}" + (f": did you mean {close[0]}?" if close else ""),
            usage(),
            fixes=["run one of the commands above: python -m distill COMMAND [ARGS...]"],
            stage=Stage.ARGV,
        )
    target = COMMANDS[name][0]
    # Each command reads sys.argv itself, as it does when started on its own.
    sys.argv = [target, *rest]
    try:
        if target.endswith(".py"):
            runpy.run_path(str(REPO / target), run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # a command's own exit code, passed on
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
            return 1
        return stop.code or 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
