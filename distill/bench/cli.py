"""How fast is a distillation step, where does its time go, and how much of it is the trainer's own?

    python -m distill.bench --preset cpu-tiny  --json outputs/bench/cpu-tiny.json
    python -m distill.bench --preset cpu-small --json outputs/bench/cpu-small.json   # ~1 min, 2 CPU cores
    python -m distill.bench --preset gpu-1.3b-pictures --json outputs/bench/gpu-1.3b-pictures.json  # CUDA
    python -m distill.bench --preset gpu-1.3b-480p-81 [--attention_backend _native_cudnn]
    python -m distill.bench --preset gpu-a14b-lora-480p-81     # one whole A14B expert, rank-64 LoRA
    python -m distill.bench --preset gpu-teacher-720p-81       # the teacher's guided forward alone
    python -m distill.bench --preset gpu-1.3b-pictures --teacher_on_cpu
    python -m distill.bench --preset gpu-14b-slice --json outputs/bench/gpu-14b-slice.json

Any preset setting can be overridden: --steps --warmup --block --batch_size --height --width
--num_frames --text_len --teacher_layers --student_layers --dtype --teacher_on_cpu
--gradient_checkpointing --compile --peak_tflops --seed (see --help).

Everything runs in one process on real, randomly initialised `WanTransformer3DModel`s built in
memory (no teacher folder is needed): two teacher experts and a student, a `TrainingLoop` built as
`Distiller.run` builds it, fed by the real `DistillationDataset` over in-memory latents and
embeddings. It measures:

- trainer: `TrainingLoop.train_step` exactly as training calls it, with no extra syncs;
- bare: the least a step must do on the same models, optimizer and tensor shapes: the teacher's
  guided forward (cond + uncond in one batch, routed by t), student forward and backward, AdamW;
- overhead ratio = median trainer step / median bare step. The two are timed in alternating
  blocks (ABBA order), with identical timestep draws, so machine noise and expert routing hit
  both alike. On CUDA a block spans several steps so the trainer's host sync is paid as it is in
  training instead of being hidden by the per-block sync;
- phases: a separate pass of `train_step` with hooks on its parts (data iterator, teacher, student
  forward, loss backward, optimizer), each synchronised before and after; "other" is the rest;
- memory: peak CPU RSS, CUDA max allocated/reserved, and the floor (student params + grads +
  AdamW state + teacher weights where they are placed);
- FLOPs: matmul FLOPs of both models counted from their shapes, attention's two products included
  (4 x tokens^2 x width a self-attention; backward = 2 x forward, no recomputation), achieved
  FLOP/s and, on CUDA, MFU against the device's dense bf16 peak;
- with --teacher_on_cpu on CUDA: the streamed teacher's forward against a GPU-resident copy.

Presets: cpu-tiny is the project's tiny teacher (distill.models.tiny) with config/student_tiny.json;
cpu-small is sized so compute dominates on 2 CPU cores; gpu-1.3b-pictures (one frame a sample; the
old name gpu-1.3b still works) is a Wan2.1-1.3B-shaped student
(config/student_config.json) under a teacher of the real A14B width (40 heads x 128, ffn 13824,
text 4096) cut to --teacher_layers blocks, bf16; gpu-1.3b-480p-81 and gpu-1.3b-720p-81 run it on one
81-frame clip, checkpointed; gpu-14b-slice trains a student of that width too. The LoRA presets
(gpu-a14b-lora-*-81) and the teacher presets (gpu-teacher-*-81) time one model alone, with no trainer
around it (distill.bench.model_step): one whole 40-layer expert.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from distill.bench.model_step import format_model_step
from distill.bench.run import run_bench
from distill.bench.settings import ALIASES, PRESETS, BenchSettings
from distill.bench.table import format_table
from distill.bench.warning_log import WarningLog, warning_lines
from distill.config.attention_backends import check_backend
from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.paths import Kind, PathFlag, check_paths

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> tuple[BenchSettings, Path | None]:
    parser = Parser(
        prog="python -m distill.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted([*PRESETS, *ALIASES]), default="cpu-small")
    parser.add_argument(
        "--json",
        type=Path,
        action=PathAction,
        kind=Kind.OUTPUT_FILE,
        example="bench.json",
        help="write the results here as JSON",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"))
    for name in (
        "steps",
        "warmup",
        "block",
        "batch_size",
        "height",
        "width",
        "num_frames",
        "text_len",
        "seed",
    ):
        parser.add_argument(f"--{name}", type=integer(0 if name in ("warmup", "seed") else 1))
    parser.add_argument("--teacher_layers", type=integer(1), help="blocks per teacher expert")
    parser.add_argument("--student_layers", type=integer(1), help="blocks of the student")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="teacher weights / student autocast")
    for name in ("teacher_on_cpu", "gradient_checkpointing", "compile"):
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--peak_tflops", type=number(0.0, above=True), help="peak FLOP/s for MFU (default: by device name)"
    )
    parser.add_argument(
        "--method", choices=("velocity", "dmd"), help="the training method whose step is timed (velocity)"
    )
    parser.add_argument(
        "--critic_updates", type=integer(1), help="dmd: critic updates per generator update (5)"
    )
    parser.add_argument("--student_steps", type=integer(1), help="dmd: the student's sampling steps K (4)")
    parser.add_argument("--lora_rank", type=integer(1), help="LoRA presets: the adapters' rank (64)")
    parser.add_argument(
        "--attention_backend",
        metavar="NAME",
        help="diffusers' attention backend of every model (native, _native_cudnn, _native_flash, flash, "
        "flex, ...); left out, SDPA picks its kernel",
    )
    args = vars(parser.parse_args(argv))
    preset, json_path = args.pop("preset"), args.pop("json")
    if preset in ALIASES:
        logger.warning("--preset %s is now called %s (one frame a sample)", preset, ALIASES[preset])
        preset = ALIASES[preset]
    overrides = {key: value for key, value in args.items() if value is not None}
    preset_values = dict(PRESETS[preset])
    if overrides.get("method") == "dmd":
        # A dmd bench step is a whole cycle (~critic_updates+2 velocity steps of work): fewer of them,
        # and on CUDA one cycle per timed block (it already holds several host syncs).
        preset_values["steps"] = max(6, preset_values.get("steps", BenchSettings.steps) // 4)
        preset_values["block"] = 1
    settings = BenchSettings(preset=preset, **{**preset_values, **overrides})
    for name in ("steps", "warmup", "block", "batch_size", "critic_updates", "student_steps"):
        if getattr(settings, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be positive")
    # The sizes the Wan VAE and patching take (the trainer's own rule): anything else has no tokens.
    for name in ("height", "width"):
        if getattr(settings, name) % 16:
            parser.error(
                f"--{name} must be a multiple of 16 (VAE stride 8 x patch 2), got {getattr(settings, name)}"
            )
    if settings.num_frames % 4 != 1:
        parser.error(f"--num_frames must be 4k+1 (1, 5, 9, ...), got {settings.num_frames}")
    # The trainer's own rules; a teacher-forward bench may time a kernel that only samples.
    check_backend(
        settings.attention_backend,
        settings.device,
        training=settings.workload != "teacher",
        half_precision=settings.dtype == "bfloat16",
    )
    return settings, json_path


@entry_point
def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The benchmark's results, or (returned by entry_point) the exit code of a refusal."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings, json_path = parse_args(argv)
    # Before the benchmark runs, not after: a bad --json would throw its minutes away.
    check_paths([PathFlag("--json", json_path, Kind.OUTPUT_FILE, example="bench.json")])
    with WarningLog() as log:  # a warning can be a slow path: where it came from is kept (warning_log)
        result = run_bench(settings)
    result["warnings"] = log.entries()
    print(format_table(result) if settings.workload == "distill" else format_model_step(result))
    print("\n".join(warning_lines(result["warnings"])))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    return result


if __name__ == "__main__":
    result = main(sys.argv[1:])
    sys.exit(result if isinstance(result, int) else 0)
