"""One distillation run: `trainer` sets it up (teacher, caches, student, method) and hands it to
the `loop` every method shares (ranks, accumulation, optimizers, EMA, checkpoints, logging,
preemption via `stop`); `export` writes what a finished run leaves; `methods/` says what each `--method` trains and its loss;
`checkpoint` saves and resumes; `tracking` logs (console, metrics.jsonl, wandb); `plan` is the
memory plan of `--dry_run` (`plan_parallel`: the run's plan and the --sequence_parallel degree that fits; `cp_traffic`: the all-to-all bytes of a split step); `diagnose` (with `oom` and `commands`) turns a failure into a banner
with fixes. The top library layer: it may import every other subpackage except distill.toy.
"""
