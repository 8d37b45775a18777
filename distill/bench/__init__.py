"""The step benchmark, `python -m distill.bench`: how fast a distillation step is, where its time
goes and how much of it is the trainer's own, on real randomly initialised Wan transformers built
in memory. A command of its own: it may use every layer of the trainer, and nothing imports it.

- `cli`: the command line and its presets' overrides (what the output means: its docstring)
- `settings`: the presets and the shapes of the A14B teacher they scale down
- `setup`: builds the models, the in-memory dataset and the real `TrainingLoop` around them
- `bare`: the least a step must do on the same tensors, to compare the trainer's step against
- `timing`: alternating timed blocks and the per-phase clock
- `measures`: memory, FLOPs, MFU, the environment, teacher placement
- `run` / `table`: one whole benchmark, and its table for the terminal
- `model_step`: one model's step alone (the A14B LoRA step, the teacher's guided forward)
- `plan_check`: `--dry_run`'s memory plan beside what the device really allocates
- `warning_log`: the warnings a run raised (a warning can be a slow path), with the line that raised each
"""
