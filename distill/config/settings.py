"""One typed config for a distillation run, read from the command line and an optional YAML/JSON file.

Every setting is a field of `TrainConfig` with its help text beside it, so the CLI, the config
file, `--help` and the resolved `run_config.json` written next to the student all come from the
same place. Precedence: defaults < `--config FILE` < command-line flags.

Longer than 500 lines because every setting is a field here with its help text, and the checks
that span several fields sit beside them: one place says what a flag means and when it is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.config.flag_rules import check_guidance
from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind, PathFlag, check_paths

# The kinds of prompt file distill.data.prompts reads: a folder given for one gets one of these offered.
PROMPT_SUFFIXES = (".txt", ".jsonl", ".csv", ".tsv")

# Modules of each Wan block that can take LoRA adapters (diffusers names): q/k/v/o of self- and
# cross-attention and both FFN linears, what the published few-step Wan LoRAs cover.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")


def canonical_lora_targets(names: Iterable[str]) -> tuple[str, ...]:
    """LoRA target names without repeats, in one order (LORA_TARGETS', then any other name sorted):
    the same set of modules is the same adapter shape, however the flag spelled it."""
    given = {name.strip() for name in names if name.strip()}
    return tuple(t for t in LORA_TARGETS if t in given) + tuple(sorted(given - set(LORA_TARGETS)))


# Methods whose student is a few-step generator (its --student_steps grid, exported with its scheduler),
# and those of them that also train a critic (distribution matching: dmd, and self_forcing, which
# judges a causal student's own rolled-out clip with dmd's loss).
FEW_STEP_METHODS = ("dmd", "self_forcing", "ode_init")
CRITIC_METHODS = ("dmd", "self_forcing")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, **extra: Any) -> Any:
    """A dataclass field that carries its CLI help text (and choices) as metadata."""
    return field(default=default, metadata={"help": help, "choices": choices, **extra})


def parse_betas(text: str) -> tuple[float, float]:
    """AdamW betas from 'beta1,beta2' (ValueError when it is not two numbers)."""
    first, second = (float(v) for v in text.split(","))
    return first, second


@dataclass
class TrainConfig:
    # --- where things are -------------------------------------------------------------------
    teacher_path: str | None = _opt(
        None,
        "Wan2.2-T2V-A14B teacher: a local diffusers folder or a hub id (Wan-AI/Wan2.2-T2V-A14B-Diffusers).",
    )
    student_config: str | None = _opt(None, "JSON file of WanTransformer3DModel keys for the student.")
    data_path: str | None = _opt(
        None, "Prompts: .txt (one per line), .jsonl, or .csv / .tsv with a 'prompt' column."
    )
    output_dir: str | None = _opt(None, "Where checkpoints, metrics, caches and the exported student go.")
    cache_dir: str | None = _opt(
        None, "Prompt-embedding and clean-latent caches (default <output_dir>/cache); share it between runs."
    )
    config: str | None = _opt(None, "YAML or JSON file with any of these settings; command-line flags win.")

    # --- teacher ----------------------------------------------------------------------------
    teacher_dtype: str = _opt(
        "auto",
        "Teacher weights dtype; auto = bfloat16 on CUDA, float32 on CPU.",
        ("auto", "float32", "float16", "bfloat16"),
    )
    teacher_on_cpu: bool = _opt(
        False, "Keep teacher weights in CPU RAM and stream them to the GPU group by group (CUDA only)."
    )
    teacher_placement: str = _opt(
        "auto",
        "Where the frozen teacher lives: gpu (a full copy per device), cpu (CPU RAM, streamed to the GPU), "
        "shard (FSDP2: each rank holds 1/N and gathers one block at a time), auto (chosen from measured memory).",
        ("auto", "gpu", "cpu", "shard"),
    )
    teacher_device_strategy: str | None = _opt(
        None,
        "The origin project's name for --teacher_placement: cpu, balanced (= shard), auto.",
        ("cpu", "balanced", "gpu0", "auto"),
    )
    teacher_lora: list[str] | None = _opt(
        None,
        "The user's LoRA to fuse into the teacher, PATH[:SCALE] (scale 1 when left out); repeat the flag "
        "for several. A .safetensors file (diffusers/peft, Wan/ComfyUI or musubi-tuner keys): a name with "
        "`high` or `low` says its expert, neither means both experts (or the one transformer of TI2V-5B); "
        "or a folder holding a high/low pair. Fused before any cache is built; part of the teacher's identity.",
        metavar="PATH[:SCALE]",
    )
    boundary_ratio: float | None = _opt(
        None,
        "Expert switch: t >= ratio*1000 uses the high-noise expert (default: the teacher's model_index.json).",
    )
    guidance_scale: float = _opt(4.0, "Classifier-free guidance of the high-noise expert (transformer).")
    guidance_scale_2: float = _opt(3.0, "Classifier-free guidance of the low-noise expert (transformer_2).")
    negative_prompt: str = _opt("", "Negative prompt for the unconditional branch of guidance.")
    max_sequence_length: int = _opt(512, "Text tokens per prompt (the Wan text encoder's limit is 512).")
    flow_shift: float | None = _opt(
        None,
        "Shift of the sigma schedule for training timesteps (default: the teacher scheduler's flow_shift).",
    )

    # --- student ----------------------------------------------------------------------------
    student_init: str = _opt(
        "random",
        "random, teacher (evenly spaced blocks of one expert, sliced to the student's width), "
        "or a folder / hub id of a pretrained WanTransformer3DModel.",
    )
    student_init_expert: str = _opt(
        "low", "Which expert --student_init teacher copies from.", ("high", "low")
    )
    gradient_checkpointing: bool = _opt(False, "Recompute student activations in backward to save memory.")
    student_chunk_frames: int | None = _opt(
        None,
        "Make the student causal: block-causal attention over chunks of this many latent frames (1 or 3; "
        "a latent frame is 4 video frames), so it streams chunk by chunk (generate --stream). Carried "
        "through checkpoints and the export (causal_config.json). Left out: a bidirectional student.",
    )
    student_lora_rank: int = _opt(
        0,
        "> 0: the student is the teacher's own two experts with LoRA adapters of this rank, each expert's "
        "adapter trained on its own timesteps; exported as lora/high_noise_lora.safetensors and "
        "lora/low_noise_lora.safetensors (no --student_config or --student_init with it).",
    )
    student_lora_alpha: float | None = _opt(
        None, "LoRA alpha of the student's adapters (scale alpha / rank; default: the rank, scale 1)."
    )
    student_lora_targets: str = _opt(
        ",".join(LORA_TARGETS),
        "Comma-separated module names of each block that get adapters (self- and cross-attention "
        "q/k/v/o and both FFN linears by default).",
    )
    expert_phase: str = _opt(
        "both",
        "dmd with --student_lora_rank: train both experts' adapters at once, or one expert at a time (less "
        "memory): high first, then low with --student_lora_init <the high phase's lora/>; each phase's "
        "student steps and score noise levels stay on its side of the boundary.",
        ("both", "high", "low"),
    )
    student_lora_init: str | None = _opt(
        None,
        "A lora/ folder of an earlier LoRA run (same rank, alpha and targets) to start the student's adapters "
        "from (required by --expert_phase low: the high phase's adapters run its first steps).",
    )
    critic_lora_rank: int | None = _opt(
        None,
        "dmd with --student_lora_rank: rank of the critic's own adapters on the same frozen experts "
        "(default: the student's rank); 0 trains a full copy of both experts instead (more memory).",
    )

    # --- method ------------------------------------------------------------------------------
    method: str = _opt(
        "velocity",
        "velocity: regress onto the guided teacher's velocity (a smaller student, the teacher's step count); "
        "dmd: distribution matching into a --student_steps generator (start it from a velocity student); "
        "ode_init: regress the teacher's (noise -> clean latent) pairs at the student's steps, one step "
        "per chunk of a causal student (its initialisation); self_forcing: dmd on a causal student's own "
        "chunk-by-chunk rollout (needs --student_chunk_frames; docs/streaming.md).",
        ("velocity", "dmd", "ode_init", "self_forcing"),
    )
    student_steps: int = _opt(4, "dmd: sampling steps of the student (exported with its scheduler).")
    student_shift: float = _opt(
        5.0,
        "dmd: shift of the student's flow-match step grid (set_timesteps(K)); 5 puts 2 of 4 steps on each "
        "side of the A14B boundary 0.875.",
    )
    student_shift_terminal: float | None = _opt(
        None,
        "dmd: the sigma the student's last step lands at (diffusers' shift_terminal; e.g. 0.25 gives "
        "1000, 931, 783, 250 at shift 5 and 4 steps instead of 1000, 910, 717, 24). Off by default.",
    )
    critic_config: str | None = _opt(
        None, "dmd: JSON of WanTransformer3DModel keys for the critic (default: the student's config)."
    )
    critic_init: str | None = _opt(
        None, "dmd: random, teacher or a pretrained folder for the critic (default: like the student)."
    )
    critic_updates: int = _opt(5, "dmd: critic updates per generator update.")
    critic_lr: float | None = _opt(
        None,
        "dmd: peak learning rate of the critic's AdamW (default with --method dmd: 4e-7; a LoRA critic: 1e-4).",
    )
    critic_betas: str = _opt("0,0.999", "dmd: AdamW betas of the critic, as 'beta1,beta2'.")
    generator_betas: str = _opt(
        "0,0.999", "dmd: AdamW betas of the student (generator), as 'beta1,beta2' (velocity: AdamW's own)."
    )
    dmd_inputs: str = _opt(
        "simulate",
        "dmd: the generator's inputs: simulate (its own rollout from noise to a random step) or data "
        "(the teacher's cached latents noised to one of the student's timesteps).",
        ("simulate", "data"),
    )
    regression_weight: float = _opt(
        0.0,
        "dmd: weight of an MSE term pulling the student's first step onto the teacher's (noise -> x0) pairs.",
    )
    rollout_frames: int | None = _opt(
        None,
        "self_forcing: frames of the student's training rollout, longer than --num_frames to train streaming "
        "past the trained length (e.g. 3x): each update streams this many frames on the KV cache window of "
        "generate --stream and the critic and the teacher judge a random --num_frames window of it. Whole "
        "chunks; text-to-video teachers. Left out (or equal to --num_frames): the rollout is the clip.",
    )
    reference_prompts: int = _opt(
        16,
        "dmd with simulate inputs and no regression (its updates never read the teacher's clean latents): "
        "the teacher samples clean latents only for this many prompts, at evenly spaced positions of "
        "--data_path (after --max_prompts), for the metrics that compare with the teacher (latent drift, "
        "motion). Every other run samples one per training prompt.",
    )

    # --- clean latents ----------------------------------------------------------------------
    height: int = _opt(
        480, "Training (and sampling) height in pixels; a multiple of 16 (A14B teachers) or 32 (TI2V-5B)."
    )
    width: int = _opt(832, "Training width in pixels; a multiple of 16 (A14B teachers) or 32 (TI2V-5B).")
    num_frames: int = _opt(1, "Frames per sample: 1 = image mode, 4k+1 = video.")
    teacher_sample_steps: int = _opt(40, "Teacher sampler steps used to make each clean latent x0.")
    max_prompts: int | None = _opt(None, "Use only the first N prompts of --data_path (quick trials).")

    # --- optimisation -----------------------------------------------------------------------
    batch_size: int = _opt(1, "Samples per device per micro-step.")
    gradient_accumulation_steps: int = _opt(1, "Micro-steps per optimizer step.")
    num_steps: int | None = _opt(None, "Optimizer steps to run (default 1000 unless --num_epochs is given).")
    num_epochs: int | None = _opt(None, "Passes over the prompts; used when --num_steps is not given.")
    lr: float = _opt(
        1e-4, "Peak learning rate of AdamW (default with --method dmd: 2e-6; with --student_lora_rank: 1e-4)."
    )
    lr_scheduler: str = _opt(
        "cosine",
        "Learning-rate shape after warm-up (default with --method dmd: constant).",
        ("cosine", "constant"),
    )
    lr_warmup_steps: int = _opt(0, "Linear warm-up steps.")
    weight_decay: float = _opt(0.0, "AdamW weight decay.")
    max_grad_norm: float = _opt(1.0, "Clip gradients to this global norm (0 disables clipping).")
    mixed_precision: str = _opt("no", "Autocast for the student.", ("no", "bf16", "fp16"))
    attention_backend: str | None = _opt(
        None,
        "Attention kernel of the student, critic and teacher experts, by diffusers' dispatcher name: native, "
        "_native_cudnn, _native_flash, _native_efficient, _native_math, flex, flash (flash-attn), ... "
        "Left out: SDPA picks its kernel (on CUDA the run logs which). Backends that cannot train, need "
        "missing hardware or packages, or cannot be split by --sequence_parallel are refused. Not part of "
        "the student: sampling is the same under any backend, up to kernel rounding.",
        metavar="NAME",
    )
    ema_decay: float = _opt(
        0.0, "Keep an EMA of the student with this decay (0 disables), exported as student_ema/."
    )
    seed: int = _opt(0, "Seed for initialisation, noise, timesteps and data order.")
    num_workers: int = _opt(0, "DataLoader worker processes reading the clean-latent cache.")
    device: str = _opt("auto", "auto (cuda when available), cuda, cuda:N or cpu.")

    # --- samples and evaluation ----------------------------------------------------------
    save_samples: bool = _opt(
        False,
        "Render the held-out prompts with the student every --sample_interval steps (teacher references once).",
    )
    sample_prompts: str | None = _opt(
        None, "Prompts for samples (default data/sample_prompts.txt, held out)."
    )
    sample_interval: int = _opt(500, "Steps between sample rounds.")
    sample_dir: str | None = _opt(None, "Where samples and grids go (default <output_dir>/samples).")
    sample_steps: int = _opt(
        30,
        "Sampler steps for samples, teacher references and the evaluation (dmd: the teacher's; the "
        "student uses --student_steps).",
    )
    sample_seed: int = _opt(0, "Prompt i is sampled with seed sample_seed + i, teacher and student alike.")
    eval_interval: int = _opt(0, "Steps between student-vs-teacher reports (eval.json, eval.png); 0 = off.")
    eval_prompts: str | None = _opt(None, "Prompts for the report (default: the sample prompts).")
    eval_num_buckets: int = _opt(10, "Timestep buckets over [0, 1000] in the denoiser report.")
    eval_samples_per_bucket: int = _opt(1, "Noised samples per bucket and prompt in the denoiser report.")

    # --- distributed ------------------------------------------------------------------------
    backend: str = _opt(
        "auto",
        "Process-group backend under torchrun; auto = nccl with CUDA, gloo without (DDP_BACKEND overrides auto).",
        ("auto", "nccl", "gloo"),
    )
    dist_timeout: float = _opt(
        60.0, "Minutes a collective may wait for the other ranks (covers teacher loading)."
    )
    stall_timeout: float = _opt(
        10.0,
        "Minutes without progress during training before a rank prints its stacks and the run ends "
        "(exit 11); 0 = off. Progress: the start of each step and micro-batch, every forward of a "
        "model (teacher experts, student, critic) and of each of its transformer blocks, and every "
        "backward through a block; so it must outlast one block's forward or backward and a rank's "
        "wait for slower ranks, not a whole step. Keep it well under --dist_timeout.",
    )
    distributed: bool = _opt(
        False, "Accepted for compatibility: torchrun alone decides; checked against how the run was launched."
    )
    debug_distributed: bool = _opt(
        False,
        "Log every setup step per rank and turn on NCCL/torch.distributed debug output (or DISTILL_DEBUG=1).",
    )
    teacher_load_concurrency: int = _opt(
        0, "Ranks per node that load the teacher at the same time (0 = as many as free host RAM allows)."
    )
    sequence_parallel: int = _opt(
        1,
        "Ranks that share one sample under torchrun, each holding 1/N of its tokens (Ulysses sequence "
        "parallel through diffusers' context parallel, for the student, critic and teacher experts); "
        "1 = off. N must divide the ranks per node, the attention heads and the latent token count.",
    )
    max_bad_steps: int = _opt(
        10, "Stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)."
    )

    # --- bookkeeping ------------------------------------------------------------------------
    log_every: int = _opt(10, "Log loss/lr every N steps (one host sync per logged step).")
    checkpoint_every: int = _opt(500, "Save a resumable checkpoint every N steps (0 = only at the end).")
    keep_last: int = _opt(3, "Checkpoints to keep; older ones are deleted once a newer one is complete.")
    resume: str = _opt(
        "auto", "auto (newest checkpoint in output_dir, if any), none, or a checkpoint folder."
    )
    export_formats: str = _opt(
        "diffusers",
        "Comma-separated student export formats: diffusers (student/, always written) and original "
        "(also student_original.safetensors with Wan's own key names, for Wan's code and ComfyUI); with "
        "--student_lora_rank, lora/ is always written and merged adds merged/transformer and "
        "merged/transformer_2, the experts with the adapters merged in.",
    )
    force_resume: bool = _opt(
        False,
        "Resume even if the checkpoint was made with another student config, teacher, prompts or "
        "training target (guidance, negative prompt, flow shift, boundary ratio, max_sequence_length).",
    )
    wandb_project: str | None = _opt(None, "Log to this wandb project (nothing is sent to wandb without it).")
    wandb_mode: str = _opt(
        "online",
        "wandb mode; online falls back to offline when no API key is set.",
        ("online", "offline", "disabled"),
    )
    wandb_run_name: str | None = _opt(None, "Name of the wandb run.")
    plan_world_size: int | None = _opt(
        None, "World size the memory plan is printed for (default: the one launched); try it with --dry_run."
    )
    mfu: float = _opt(
        0.4,
        "Model-FLOP utilisation the plan's GPU-hours assume: the share of an H100's 989 TFLOP/s (bf16) "
        "the run's matrix products reach, in (0, 1].",
    )
    dry_run: bool = _opt(False, "Validate everything, print the plan and memory estimate, then exit 0.")

    # Not a setting: each setting the user gave and how to name it (`--name`, or 'name' in FILE),
    # recorded by parse_config, so that a rule judged once the teacher's kind is known (a second
    # expert's guidance for a one-transformer teacher) refuses only what was asked for. Empty for
    # a config built in code, which gives nothing on a command line.
    given: typing.ClassVar[dict[str, str]] = {}

    # ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every setting that can be checked without loading a model."""
        self._resolve_placement_aliases()
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                raise config_error(
                    f.name,
                    f"must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}",
                    f"set --{f.name} to one of {', '.join(choices)}",
                )
        self._validate_lora()
        for name in ("teacher_path", "student_config", "data_path", "output_dir"):
            if name == "student_config" and self.student_lora_rank:
                continue  # the student is the teacher's experts
            if not getattr(self, name):
                raise config_error(name, "is required", f"pass --{name} (or set '{name}' in --config)")
        positive = [
            "height",
            "width",
            "num_frames",
            "teacher_sample_steps",
            "batch_size",
            "gradient_accumulation_steps",
            "max_sequence_length",
            "log_every",
            "keep_last",
            "max_bad_steps",
            "sample_interval",
            "sample_steps",
            "eval_num_buckets",
            "eval_samples_per_bucket",
            "student_steps",
            "critic_updates",
            "reference_prompts",
            "sequence_parallel",
        ]
        self._validate_finite()
        check_guidance(
            ("--guidance_scale", self.guidance_scale), ("--guidance_scale_2", self.guidance_scale_2)
        )
        for name in positive + ["num_steps", "num_epochs", "max_prompts", "plan_world_size"]:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise config_error(
                    name, f"must be a positive integer, got {value}", f"set --{name} to 1 or more"
                )
        unknown_formats = set(self.export_formats.split(",")) - {"diffusers", "original", "merged"}
        if unknown_formats:
            raise config_error(
                "export_formats",
                f"has unknown format(s) {', '.join(sorted(unknown_formats))}",
                "use --export_formats diffusers or --export_formats diffusers,original "
                "(with --student_lora_rank: diffusers,merged)",
            )
        if "merged" in self.export_formats.split(",") and not self.student_lora_rank:
            raise config_error(
                "export_formats",
                "merged writes the teacher's experts with a LoRA student's adapters merged in; this run has none",
                "add --student_lora_rank, or drop merged",
            )
        if self.dist_timeout <= 0:
            raise config_error("dist_timeout", "must be positive (minutes)", "try --dist_timeout 60")
        if self.stall_timeout < 0:
            raise config_error(
                "stall_timeout", "must be 0 (off) or positive (minutes)", "try --stall_timeout 10"
            )
        if not 0.0 < self.mfu <= 1.0:
            raise config_error(
                "mfu", f"must lie in (0, 1] (a share of the GPU's peak), got {self.mfu}", "try --mfu 0.4"
            )
        for name in (
            "checkpoint_every",
            "lr_warmup_steps",
            "num_workers",
            "teacher_load_concurrency",
            "eval_interval",
        ):
            if getattr(self, name) < 0:
                raise config_error(name, "must be 0 or more", f"set --{name} 0")
        if self.num_frames % 4 != 1:
            k = max(1, round((self.num_frames - 1) / 4))
            raise config_error(
                "num_frames",
                f"must be 4k+1 (the Wan VAE compresses time by 4), got {self.num_frames}",
                f"use --num_frames 1 for images or --num_frames {4 * k + 1} for video",
            )
        # --height and --width are checked once the teacher's files are read (check_sample_size): the
        # multiple is its VAE's stride times its patch, 16 for the A14B models and 32 for TI2V-5B, so a
        # size fix offered here, before the teacher is known, could name a size that model refuses.
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise config_error(
                "boundary_ratio", f"must lie in (0, 1), got {self.boundary_ratio}", "Wan 2.2 uses 0.875"
            )
        if self.lr <= 0:
            raise config_error("lr", f"must be positive, got {self.lr}", "try --lr 1e-4")
        if not 0.0 <= self.ema_decay < 1.0:
            raise config_error(
                "ema_decay", f"must lie in [0, 1), got {self.ema_decay}", "try --ema_decay 0.999"
            )
        self._validate_method()
        if self.max_grad_norm < 0:
            raise config_error("max_grad_norm", "must be 0 (off) or positive", "try --max_grad_norm 1.0")
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise config_error("flow_shift", f"must be positive, got {self.flow_shift}", "Wan 2.2 uses 3.0")
        if self.resume not in ("auto", "none") and not Path(self.resume).is_dir():
            raise config_error(
                "resume",
                f"is neither auto, none nor an existing checkpoint folder: {self.resume}",
                "pass --resume auto to continue from the newest checkpoint in --output_dir",
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise config_error("device", f"unknown device {self.device!r}", "use auto, cpu, cuda or cuda:N")
        self._validate_not_negative()
        self._validate_attention_backend()
        # Paths last, by kind only (a stat each, nothing written): a file where a folder goes fails
        # here, before the teacher is read; Distiller proves the output folders writable.
        check_paths(self.path_flags(), probe=False)

    def _validate_attention_backend(self) -> None:
        """A backend that cannot train on this run's device, precision or --sequence_parallel is refused
        before the teacher is read. Attention runs in half precision only if both the student does
        (autocast, or a LoRA student on bf16 experts) and the teacher (its dtype, auto = bf16 on CUDA)."""
        if self.attention_backend is None:
            return
        import torch

        from distill.config.attention_backends import check_backend

        cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
        teacher_half = self.teacher_dtype in ("bfloat16", "float16") or (
            self.teacher_dtype == "auto" and cuda
        )
        student_half = self.mixed_precision != "no" or bool(self.student_lora_rank)
        check_backend(
            self.attention_backend,
            "cuda" if cuda else "cpu",
            half_precision=student_half and teacher_half,
            sequence_parallel=self.sequence_parallel,
        )

    def _validate_not_negative(self) -> None:
        """No number setting means anything below 0 (a seed, a weight, a rate, a shift): those without
        a rule of their own above, or whose rule applies only to some runs, are refused here too."""
        types = field_types()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            base = next((a for a in typing.get_args(types[f.name]) if a is not type(None)), types[f.name])
            if base in (int, float) and value is not None and value < 0:
                default = f" (its default is {f.default})" if f.default is not None else ""
                raise config_error(
                    f.name, f"must be 0 or more, got {value}", f"set --{f.name} to 0 or more{default}"
                )

    def _validate_finite(self) -> None:
        """inf or nan in any number setting: refused before it trains a student of NaNs."""
        types = field_types()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            base = next((a for a in typing.get_args(types[f.name]) if a is not type(None)), types[f.name])
            if base is float and value is not None and not math.isfinite(value):
                default = f" (its default is {f.default})" if f.default is not None else ""
                raise config_error(
                    f.name, f"must be a finite number, got {value}", f"give --{f.name} a number{default}"
                )

    def _validate_lora(self) -> None:
        if self.student_lora_rank < 0:
            raise config_error(
                "student_lora_rank", "must be 0 (off) or positive", "try --student_lora_rank 64"
            )
        if not self.student_lora_rank:
            return  # LoRA settings given without a rank: distill.config.flag_rules refuses them
        if self.expert_phase != "both" and not self.trains_critic:
            raise config_error(
                "expert_phase",
                "one expert at a time is a dmd schedule",
                "use --method dmd, or drop --expert_phase",
            )
        if self.expert_phase == "low" and not self.student_lora_init:
            raise config_error(
                "expert_phase",
                "low trains the low-noise adapter on the samples the distilled high-noise adapter starts, "
                "so it needs that adapter",
                "run --expert_phase high first, then add --student_lora_init <its output_dir>/lora",
            )
        given = {
            "student_config": self.student_config is not None,
            "student_init": self.student_init != "random",
            "critic_config": self.critic_config is not None,
            "critic_init": self.critic_init is not None,
        }
        for name, present in given.items():
            if present:
                raise config_error(
                    name,
                    "cannot be combined with --student_lora_rank: the student (and the critic) are the "
                    "teacher's own experts with adapters",
                    f"drop --{name}, or drop --student_lora_rank to distil into a separate student",
                )
        if self.student_lora_alpha is not None and self.student_lora_alpha <= 0:
            raise config_error("student_lora_alpha", "must be positive", "leave it out (alpha = rank)")
        if self.critic_lora_rank is not None and self.critic_lora_rank < 0:
            raise config_error(
                "critic_lora_rank", "must be 0 (a full critic) or positive", "try --critic_lora_rank 64"
            )
        if self.critic_lora_rank is not None and not self.trains_critic:
            raise config_error(
                "critic_lora_rank", "only --method dmd trains a critic", "drop --critic_lora_rank"
            )
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or not self.lora_targets:
            raise config_error(
                "student_lora_targets",
                f"has unknown module name(s) {', '.join(unknown) or '(none given)'}",
                f"choose among {','.join(LORA_TARGETS)}",
            )
        # Stored and compared as one canonical list: to_q,to_q is to_q, and to_v,to_q is to_q,to_v.
        self.student_lora_targets = ",".join(self.lora_targets)
        if "original" in self.export_formats.split(","):
            raise config_error(
                "export_formats",
                "original writes a separate student; a LoRA run exports adapters (lora/, with Wan-format "
                "keys in lora/comfyui/)",
                "drop original from --export_formats",
            )
        if self.teacher_placement == "cpu":
            raise config_error(
                "teacher_placement",
                "cpu is not available with --student_lora_rank: the adapters train inside the teacher's "
                "experts, which must then compute on the training device",
                "use --teacher_placement gpu, or shard with several GPUs (or auto)",
            )
        if self.teacher_placement == "shard" and self.trains_critic and not self.critic_adapter_rank:
            raise config_error(
                "critic_lora_rank",
                "0 (a full critic) copies both experts whole onto every rank, which --teacher_placement "
                "shard is there to avoid",
                "give the critic adapters (leave --critic_lora_rank out: the student's rank), or use "
                "--teacher_placement gpu",
            )

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return canonical_lora_targets(self.student_lora_targets.split(","))

    @property
    def phase_experts(self) -> tuple[str, ...]:
        """The experts whose adapters this run trains ("high" = transformer, "low" = transformer_2)."""
        return ("high", "low") if self.expert_phase == "both" else (self.expert_phase,)

    @property
    def lora_alpha(self) -> float:
        """The student's LoRA alpha as used: --student_lora_alpha, else the rank (scale 1)."""
        return (
            self.student_lora_alpha if self.student_lora_alpha is not None else float(self.student_lora_rank)
        )

    @property
    def critic_adapter_rank(self) -> int:
        """The dmd critic's adapter rank with --student_lora_rank; 0 means a full copy of the experts."""
        return self.student_lora_rank if self.critic_lora_rank is None else self.critic_lora_rank

    @property
    def few_step(self) -> bool:
        """Whether the student is a --student_steps generator (exported with its scheduler)."""
        return self.method in FEW_STEP_METHODS

    @property
    def longer_rollout(self) -> bool:
        """Whether --rollout_frames asks for more than the clip (None, 0 and --num_frames do not)."""
        return bool(self.rollout_frames) and self.rollout_frames != self.num_frames

    @property
    def trains_critic(self) -> bool:
        """Whether the method trains a critic beside the student (distribution matching)."""
        return self.method in CRITIC_METHODS

    def _validate_method(self) -> None:
        from distill.config.causal_rules import check_causal_settings

        check_causal_settings(self)
        if not self.trains_critic:
            return
        if self.student_init == "random" and not self.student_lora_rank:
            raise DistillError(
                f"--method {self.method} needs a student that can already denoise: --student_init is random",
                "Distribution matching sharpens a generator; it does not teach one from nothing. A random "
                "student (and its critic, which starts like it) spends the run learning what stage 1 "
                "teaches far more cheaply, and published recipes always start from trained weights.",
                fixes=[
                    "run stage 1 first (velocity distillation at --guidance_scale 1 --guidance_scale_2 1), "
                    "then --student_init <stage-1 output>/student (README: the two-stage recipe)",
                    "or --student_init teacher: the student's blocks copied from one teacher expert",
                ],
                stage=Stage.CONFIG,
            )
        for name in ("critic_betas", "generator_betas"):
            try:
                betas = parse_betas(getattr(self, name))
            except ValueError:
                betas = (-1.0, -1.0)
            if not all(0.0 <= b < 1.0 for b in betas):
                raise config_error(
                    name,
                    f"must be two numbers in [0, 1) like 0,0.999, got {getattr(self, name)!r}",
                    f"try --{name} 0,0.999",
                )
        if self.critic_lr is not None and self.critic_lr <= 0:
            raise config_error("critic_lr", f"must be positive, got {self.critic_lr}", "try --critic_lr 2e-6")
        if self.student_shift_terminal is not None and not 0 < self.student_shift_terminal < 1:
            raise config_error(
                "student_shift_terminal",
                f"must be a sigma between 0 and 1, got {self.student_shift_terminal}",
                "try --student_shift_terminal 0.25, or leave it out",
            )
        if self.student_shift <= 0:
            raise config_error(
                "student_shift", f"must be positive, got {self.student_shift}", "try --student_shift 5"
            )
        if self.regression_weight < 0:
            raise config_error(
                "regression_weight", "must be 0 (off) or positive", "try --regression_weight 0.25"
            )

    @property
    def critic_betas_tuple(self) -> tuple[float, float]:
        return parse_betas(self.critic_betas)

    @property
    def generator_betas_tuple(self) -> tuple[float, float]:
        return parse_betas(self.generator_betas)

    def _resolve_placement_aliases(self) -> None:
        """Fold --teacher_on_cpu and the origin --teacher_device_strategy into --teacher_placement."""
        if self.teacher_device_strategy is not None:
            if self.teacher_device_strategy == "gpu0":
                raise config_error(
                    "teacher_device_strategy",
                    "gpu0 (the whole teacher on GPU 0, serving every rank) has no equivalent here: every rank "
                    "needs the teacher's outputs for its own samples",
                    "use --teacher_placement shard (each GPU holds 1/N of the teacher) or --teacher_placement gpu",
                )
            alias = {"cpu": "cpu", "balanced": "shard", "auto": "auto"}[self.teacher_device_strategy]
            if self.teacher_placement not in ("auto", alias):
                raise config_error(
                    "teacher_device_strategy",
                    f"{self.teacher_device_strategy} means --teacher_placement {alias}, but "
                    f"--teacher_placement {self.teacher_placement} was also given",
                    "give only --teacher_placement",
                )
            self.teacher_placement = alias
        if self.teacher_on_cpu:
            if self.teacher_placement not in ("auto", "cpu"):
                raise config_error(
                    "teacher_on_cpu",
                    f"conflicts with --teacher_placement {self.teacher_placement}",
                    "give only one of them (--teacher_on_cpu is --teacher_placement cpu)",
                )
            self.teacher_placement = "cpu"
        elif self.teacher_placement == "cpu":
            self.teacher_on_cpu = True

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else Path(self.output_dir) / "cache"

    def path_flags(self) -> list[PathFlag]:
        """Every path setting and what it must be (distill.ops.paths). A teacher or a pretrained
        start may be a hub id; a missing student folder, LoRA folder or sample prompts file is left
        to its loader, which names it in its own terms (and finds the shipped sample prompts)."""
        flags = [
            PathFlag("--output_dir", self.output_dir, Kind.OUTPUT_FOLDER),
            # The default <output_dir>/cache too: a stray file there would stop the run after setup.
            PathFlag("--cache_dir", self.resolved_cache_dir if self.output_dir else None, Kind.OUTPUT_FOLDER),
            PathFlag("--sample_dir", self.sample_dir, Kind.OUTPUT_FOLDER),
            PathFlag("--config", self.config, Kind.FILE, suffixes=(".yaml", ".yml", ".json")),
            PathFlag("--teacher_path", self.teacher_path, Kind.FOLDER_OR_HUB),
            PathFlag("--student_config", self.student_config, Kind.FILE_OR_FOLDER),
            PathFlag("--critic_config", self.critic_config, Kind.FILE_OR_FOLDER),
            PathFlag("--data_path", self.data_path, Kind.PROMPTS, Stage.DATA),
            PathFlag("--sample_prompts", self.sample_prompts, Kind.PROMPTS, must_exist=False),
            PathFlag("--eval_prompts", self.eval_prompts, Kind.PROMPTS, must_exist=False),
            PathFlag("--student_lora_init", self.student_lora_init, Kind.FOLDER, must_exist=False),
        ]
        for name in ("student_init", "critic_init"):
            value = getattr(self, name)
            if value not in (None, "random", "teacher"):
                flags.append(PathFlag(f"--{name}", value, Kind.FOLDER_OR_HUB))
        return flags

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_error(name: str, problem: str, fix: str) -> DistillError:
    return DistillError(f"--{name} {problem}", fixes=[fix], stage=Stage.CONFIG)


# ---------------------------------------------------------------------------------------------
# Command line and config file
# ---------------------------------------------------------------------------------------------


def field_types() -> dict[str, Any]:
    """Each setting's type (a copy: the caller may change it)."""
    return dict(_field_types())


@functools.cache
def _field_types() -> dict[str, Any]:
    # Resolving the annotations' strings of some 150 settings, 5 times per parsed command line, was
    # 0.3% of the suite's CPU.
    return typing.get_type_hints(TrainConfig)


def field_defaults() -> dict[str, Any]:
    """Each setting's value when left out (a flag given at it changes nothing)."""
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}
