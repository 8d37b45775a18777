"""Distil the Wan 2.2 A14B teacher into a compact WanTransformer3DModel student.

One process:
    python train_distillation.py \\
        --teacher_path Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --student_config config/student_config.json \\
        --data_path data/static_prompts.txt \\
        --output_dir outputs/run1

Data-parallel on one node (same flags):
    torchrun --standalone --nproc_per_node=8 train_distillation.py ...

`python train_distillation.py --help` lists every setting; `--config run.yaml` reads them from a file.
Every failure ends with a banner on stderr naming the rank, what went wrong and how to fix it, and
an exit code per stage (see TORCHRUN_ERROR_FIXES.md). The student is written to <output_dir>/student/.
"""

from __future__ import annotations

import logging
import os
import sys


def debug_requested(argv: list[str]) -> bool:
    """--debug_distributed (on the command line or in --config) or DISTILL_DEBUG=1."""
    if os.environ.get("DISTILL_DEBUG") == "1":
        return True
    from distill.config.cli import parse_config  # no torch: this runs before torch is imported

    try:
        return parse_config(argv).debug_distributed
    except Exception:  # a DistillError or any other: run() reports it in the banner, not this early look
        return "--debug_distributed" in argv


# Before anything imports torch: a Python without the requirements is told which Python to use.
if __name__ == "__main__":
    from distill.ops.requirements import require_installed

    require_installed()

# torch reads these once, when it loads (the C++ log level) or when torch.distributed is imported:
# set them before the first torch import.
if __name__ == "__main__" and debug_requested(sys.argv[1:]):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "INFO")
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "INFO")

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

# A run stopped by a preemption signal saved its checkpoint and is not finished: EX_TEMPFAIL tells
# schedulers and retry loops to run it again.
EXIT_PREEMPTED = 75


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (main() may run more than once)."""

    @property
    def stream(self):  # noqa: ANN201 - logging's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; other ranks only warnings, so the console is not repeated N times."""
    prefix = f"[Rank {rank}] " if os.environ.get("RANK") is not None else ""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[_CurrentStderr()],
        force=True,
    )
    for name in ("diffusers", "transformers", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.WARNING)


def report_failure(error: BaseException) -> int:
    """The banner and exit code for the exception that ended the run, whatever happens meanwhile."""
    from distill.ops import workers  # set torch's SIGCHLD handler aside since the loader started
    from distill.ops.errors import report
    from distill.train.diagnose import failure_report, unexpected_error

    workers.silence_worker_signals()  # in case a loader outside the training loop had workers
    try:
        return report(failure_report(error))
    except Exception:  # diagnosing failed too: the first failure, plainly, is still the one to report
        return report(unexpected_error(error))


def teardown() -> None:
    """Stop what the run started; a failure here is one line and never replaces the run's outcome."""
    from distill.ops import distributed, watchdog, workers
    from distill.ops.errors import quietly

    quietly("stopping the DataLoader workers", workers.shutdown)
    quietly("stopping the stall watchdog", watchdog.stop)
    quietly("destroying the process group", distributed.teardown)


def run(argv: list[str]) -> int:
    from distill.config.cli import parse_config
    from distill.ops import distributed, watchdog
    from distill.ops.errors import DistillError, Progress, Stage

    Progress.argv = argv
    Progress.enter(Stage.ARGV)
    try:
        cfg = parse_config(argv)
        if cfg.distributed and not distributed.launched_by_torchrun():
            raise DistillError(
                "--distributed was given, but this process was not started by torchrun",
                "Data-parallel training is chosen by the launcher: torchrun starts one process per GPU.",
                fixes=[
                    "torchrun --standalone --nproc_per_node=N train_distillation.py ...",
                    "or drop --distributed for a single-process run",
                ],
                stage=Stage.ARGV,
            )
        Progress.enter(Stage.SETUP)
        debug = cfg.debug_distributed or os.environ.get("DISTILL_DEBUG") == "1"
        ctx = distributed.setup(cfg.backend, cfg.device, cfg.dist_timeout, debug)
        watchdog.start(cfg.stall_timeout)
        from distill.train.trainer import Distiller

        Progress.enter(Stage.TEACHER_LOAD)
        distiller = Distiller(cfg, ctx)
        if cfg.dry_run:
            if ctx.is_main:
                print(
                    "dry run: every setting, the teacher layout, the student config and the prompts are valid."
                )
                print(distiller.plan())
            return 0
        result = distiller.run()
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which stops at a step boundary itself)
        from distill.ops import workers
        from distill.ops.errors import current_rank

        workers.silence_worker_signals()
        # The interrupt can cut an object off in its constructor (a progress bar); its __del__ then
        # complains at exit with a traceback that would follow this banner and say nothing of use.
        sys.unraisablehook = lambda _unraisable: None
        rank = current_rank()
        print(
            f"{f'[Rank {rank}] ' if rank is not None else ''}interrupted during {Progress.where()}: what was finished is kept (cache entries, checkpoints); "
            "rerun the same command to continue.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    except Exception as error:  # recognised failures get their own advice, anything else its traceback
        return report_failure(error)
    finally:
        teardown()
    if not ctx.is_main:
        return EXIT_PREEMPTED if result.stopped_by_signal else 0
    if result.stopped_by_signal:
        print(f"stopped by {result.stopped_by_signal} at step {result.steps}; checkpoint saved.")
        print("rerun the same command (with --resume auto, the default) to continue.")
        return EXIT_PREEMPTED
    if result.last_loss is None:  # resumed at its last step: nothing was left to train
        print(f"done: {result.steps} steps, nothing left to train")
    else:
        print(f"done: {result.steps} steps, loss {result.first_loss:.4g} -> {result.last_loss:.4g}")
    if result.student_dir is not None and result.student_dir.name.startswith("lora"):
        print(f"LoRA adapters:             {result.student_dir}  (Wan-format copies in comfyui/)")
    else:
        print(f"student (diffusers format): {result.student_dir}")
    if result.ema_dir:
        print(f"EMA student:               {result.ema_dir}")
    print(f"metrics:                   {result.output_dir / 'metrics.jsonl'}")
    print(f"checkpoints:               {result.output_dir / 'checkpoints'}")
    return 0


@record
def main(argv: list[str] | None = None) -> int:
    setup_logging(int(os.environ.get("RANK", "0")))
    return run(list(sys.argv[1:] if argv is None else argv))


def leave(code: int) -> None:
    """End the process with `code`.

    Under torchrun, once the run has torn itself down (process group destroyed, workers and
    watchdog stopped, files closed), a rank leaves without the interpreter's finalization: on a
    machine starved of CPU, C++ threads of torch.distributed being destroyed at that point
    occasionally aborted the process ("terminate called without an active exception", SIGABRT)
    after a run that had finished or stopped cleanly, replacing its exit code.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
