"""Run under torchrun by tests/test_sequence_parallel.py: several training runs in one launch, on the
same process group (one launch instead of one per method), with or without --sequence_parallel.

torchrun --standalone --nproc_per_node=N tests/sequence_parallel_check.py ARGS_FILE

ARGS_FILE holds one JSON list of runs, each a command line (a list of arguments) or
{"argv": [...], "fault": "sigterm:2"}: that run is stopped by the fault (DISTILL_INJECT_FAULT) and
then run again, resuming from the checkpoint the stop wrote; {"argv": [...], "measure": true}: each
rank prints the peak of its live tensors over the training steps (as tests/test_memory_plan.py
measures one process). Every run must finish.
"""

import json
import os
import sys
from pathlib import Path

from distill.config.cli import parse_config
from distill.models import guided_teacher, lockstep, lora
from distill.models.context_parallel import enable_context_parallel
from distill.ops import distributed, watchdog
from distill.ops.live_memory import LiveTensorMemory
from distill.train import sequence_parallel
from distill.train.loop import TrainingLoop
from distill.train.trainer import Distiller
from train_distillation import setup_logging

# Sequence lengths the last block of every split transformer saw (after the split at blocks.0).
SEEN: set[int] = set()
SPLIT: list[str] = []
# Token counts of the placeholder forwards this rank ran around sharded experts (distill.models.lockstep).
PLACEHOLDERS: list[int] = []


def counted_placeholder(hidden_states, timestep, text, patch_size, split=1):
    """lockstep.placeholder_inputs, recording how many tokens the placeholder has."""
    box, *rest = lockstep.placeholder_inputs(hidden_states, timestep, text, patch_size, split)
    PLACEHOLDERS.append(box.shape[2] * box.shape[3] * box.shape[4] // (patch_size[1] * patch_size[2]))
    return (box, *rest)


def watch_split(model, mesh) -> int:
    """enable_context_parallel, plus a hook that records what each split transformer's last block
    sees: proof the tokens were split, not merely the result equal."""
    from diffusers import WanTransformer3DModel

    fresh = [
        m for m in model.modules() if isinstance(m, WanTransformer3DModel) and m._parallel_config is None
    ]
    count = enable_context_parallel(model, mesh)
    for module in fresh:
        SPLIT.append(type(model).__name__)
        module.blocks[-1].register_forward_pre_hook(
            lambda _m, args, kwargs: SEEN.add((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True,
        )
    return count


def measured(distiller: Distiller) -> int:
    """Run `distiller`, counting live tensors from its first training step on: what the run holds
    then (the teacher's and the trained models' weights, the negative prompt) and every allocation
    after, until the run ends. Returns the peak in bytes. (DDP's gradient buckets, allocated when the
    models are wrapped, are not held: the plan's row for them is left out of the comparison.)"""
    memory, started, step = LiveTensorMemory(), [], TrainingLoop.train_step

    def counted_step(loop: TrainingLoop, *args, **kwargs):
        if not started:
            started.append(True)
            models = [loop.teacher.high, loop.teacher.low, *loop.models.values()]
            memory.hold(t for m in models if m is not None for t in [*m.parameters(), *m.buffers()])
            memory.hold([loop.negative])
            memory.__enter__()
        return step(loop, *args, **kwargs)

    TrainingLoop.train_step = counted_step
    try:
        distiller.run()
    finally:
        TrainingLoop.train_step = step
        if started:
            memory.__exit__(None, None, None)
    return memory.peak


def say(line: str) -> None:
    """One line to stdout in one write: the ranks share the pipe, and print's separate writes of the
    text and its newline can interleave with another rank's line."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def main() -> int:
    args_file = sys.argv[1]
    sequence_parallel.enable_context_parallel = watch_split
    guided_teacher.placeholder_inputs = lora.placeholder_inputs = counted_placeholder
    runs = [
        run if isinstance(run, dict) else {"argv": run} for run in json.loads(Path(args_file).read_text())
    ]
    configs = [parse_config(run["argv"]) for run in runs]
    setup_logging(int(os.environ["RANK"]))
    ctx = distributed.setup(configs[0].backend, configs[0].device, configs[0].dist_timeout)
    watchdog.start(configs[0].stall_timeout)
    try:
        for run, cfg in zip(runs, configs):
            if "fault" in run:
                os.environ["DISTILL_INJECT_FAULT"] = run["fault"]
                stopped = Distiller(cfg, ctx).run()
                del os.environ["DISTILL_INJECT_FAULT"]
                say(f"rank {ctx.rank} stopped {cfg.output_dir} by {stopped.stopped_by_signal}")
                SEEN.clear()
                SPLIT.clear()
                PLACEHOLDERS.clear()
            if run.get("measure"):
                say(f"rank {ctx.rank} measured {cfg.output_dir}: peak {measured(Distiller(cfg, ctx))} bytes")
            else:
                result = Distiller(cfg, ctx).run()
                say(
                    f"rank {ctx.rank} finished {cfg.output_dir}: {result.steps} steps, split {len(SPLIT)} "
                    f"transformer(s), their blocks saw sequence lengths {sorted(SEEN)}, "
                    f"{len(PLACEHOLDERS)} placeholder forward(s) of {sorted(set(PLACEHOLDERS))} tokens"
                )
            SEEN.clear()
            SPLIT.clear()
            PLACEHOLDERS.clear()
    finally:
        watchdog.stop()
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
