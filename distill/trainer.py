"""The distillation run: prepare, train the student on the teacher's guided velocities, export.

One step: draw clean latents x0 from the cache, fresh noise and timesteps, form x_t, ask the
teacher experts (routed by t, with guidance) for the target velocity, regress the student onto
it with MSE. Host syncs happen only at logged steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distill import checkpoint as ckpt
from distill.config import TrainConfig, save_resolved_config
from distill.data import DistillationDataset, ResumableSampler, read_prompts
from distill.errors import DistillError, Stage
from distill.faults import FaultInjector
from distill.objective import add_noise, high_noise_mask, per_sample_mse, sample_sigmas, sigmas_to_timesteps
from distill.prepare import embedding_cache, fill_embedding_cache, fill_latent_cache, latent_cache
from distill.student import (
    build_student,
    count_parameters,
    export_student,
    init_student_from_teacher,
    load_pretrained_student,
    load_student_config,
)
from distill.teacher import (
    GuidedTeacher,
    TeacherInfo,
    inspect_teacher,
    load_expert,
    place_expert,
    resolve_dtype,
)
from distill.tracking import Tracker

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run produced, for the entry point to print and tests to check."""

    output_dir: Path
    steps: int
    student_dir: Path | None = None
    ema_dir: Path | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    embeddings_built: int = 0
    latents_built: int = 0
    resumed_from: Path | None = None
    history: list[dict[str, float]] = field(default_factory=list)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DistillError(
            f"--device {name} asked for CUDA, but torch sees no GPU",
            f"torch {torch.__version__}, CUDA build: {torch.version.cuda}",
            fixes=["use --device auto (or cpu)", "install a CUDA build of torch on a GPU node"],
            stage=Stage.SETUP,
        )
    return device


# ---------------------------------------------------------------------------------------------
# Checks before any heavy work
# ---------------------------------------------------------------------------------------------


def check_resolution(cfg: TrainConfig, info: TeacherInfo) -> None:
    multiple = info.vae_scale_spatial * info.patch_size[1]
    for name in ("height", "width"):
        value = getattr(cfg, name)
        if value % multiple:
            raise DistillError(
                f"--{name} {value} is not a multiple of {multiple} (VAE stride {info.vae_scale_spatial} x patch "
                f"{info.patch_size[1]})",
                fixes=[f"use --{name} {max(multiple, value // multiple * multiple)}"],
                stage=Stage.CONFIG,
            )


def memory_plan(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], world_size: int = 1
) -> str:
    """A readable estimate of parameters and per-device memory, for --dry_run and the start banner."""
    teacher_params = count_parameters(info.expert_config)
    student_params = count_parameters(student_config)
    device = pick_device(cfg.device)
    teacher_bytes = torch.finfo(resolve_dtype(cfg.teacher_dtype, device)).bits // 8
    gib = 1024**3
    teacher_gb = 2 * teacher_params * teacher_bytes / gib
    # fp32 weights + grads + two AdamW moments, plus the EMA copy when enabled.
    student_gb = student_params * (16 + (4 if cfg.ema_decay else 0)) / gib
    c, f, h, w = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    tokens = f * (h // info.patch_size[1]) * (w // info.patch_size[2])
    width = student_config["num_attention_heads"] * student_config["attention_head_dim"]
    layers = student_config["num_layers"]
    per_layer = (
        cfg.batch_size * tokens * width * 4 * 12
    )  # rough: ~12 saved fp32 activations of the width per token
    act_gb = (per_layer * (1 if cfg.gradient_checkpointing else layers) + per_layer) / gib
    on_device_teacher = 0.0 if cfg.teacher_on_cpu else teacher_gb
    lines = [
        f"teacher   : {info.path}",
        f"  experts : 2 x {teacher_params / 1e9:.2f} B parameters ({teacher_gb:.1f} GiB as {cfg.teacher_dtype}), "
        f"boundary t >= {info.boundary_ratio * 1000:.0f} -> high-noise expert",
        f"student   : {student_params / 1e9:.3f} B parameters, {layers} layers, width {width}",
        f"latents   : {(c, f, h, w)} per sample, {tokens} tokens",
        f"memory per device (rough, world size {world_size}):",
        f"  teacher weights       {on_device_teacher:8.2f} GiB"
        + ("  (in CPU RAM, streamed)" if cfg.teacher_on_cpu else ""),
        f"  student+grads+AdamW   {student_gb:8.2f} GiB",
        f"  activations (batch {cfg.batch_size}) {act_gb:8.2f} GiB"
        + ("  (gradient checkpointing)" if cfg.gradient_checkpointing else ""),
        f"  total                 {on_device_teacher + student_gb + act_gb:8.2f} GiB",
    ]
    return "\n".join(lines)


def prepare_output_dir(cfg: TrainConfig) -> Path:
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DistillError(
            f"--output_dir {out} is not writable",
            f"{type(exc).__name__}: {exc}",
            fixes=["choose a folder you can write to, on a disk with room for checkpoints"],
            stage=Stage.CONFIG,
        ) from None
    return out


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


class Distiller:
    """Holds everything a run needs; `run()` goes from caches to exported student."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.info = inspect_teacher(cfg.teacher_path, cfg.boundary_ratio)
        # Refuse a student that cannot work with this teacher before loading anything heavy.
        self.student_config = load_student_config(cfg.student_config, self.info.expert_config)
        check_resolution(cfg, self.info)
        self.prompts = read_prompts(cfg.data_path)[: cfg.max_prompts]
        self.teacher_dtype = resolve_dtype(cfg.teacher_dtype, self.device)
        self.shift = cfg.flow_shift if cfg.flow_shift is not None else self.info.flow_shift
        self.is_main = True

    def plan(self) -> str:
        return memory_plan(self.cfg, self.info, self.student_config)

    # -- preparation -----------------------------------------------------------------------
    def prepare_caches(self, result: RunResult) -> tuple[Any, Any, torch.Tensor, GuidedTeacher]:
        cfg = self.cfg
        embeddings = embedding_cache(cfg, self.info, self.teacher_dtype)
        result.embeddings_built = fill_embedding_cache(
            embeddings,
            [*self.prompts, cfg.negative_prompt],
            self.info,
            cfg.max_sequence_length,
            self.device,
            self.teacher_dtype,
            show_progress=self.is_main,
        )
        negative = embeddings.get(cfg.negative_prompt)
        high = place_expert(
            load_expert(self.info, "transformer", self.teacher_dtype), self.device, cfg.teacher_on_cpu
        )
        low = place_expert(
            load_expert(self.info, "transformer_2", self.teacher_dtype), self.device, cfg.teacher_on_cpu
        )
        latents = latent_cache(cfg, self.info, self.teacher_dtype, embeddings)
        result.latents_built = fill_latent_cache(
            latents, self.prompts, embeddings, negative, cfg, self.info, high, low, self.device, self.is_main
        )
        teacher = GuidedTeacher(
            high,
            low,
            self.info.boundary_ratio,
            cfg.guidance_scale,
            cfg.guidance_scale_2,
            self.device,
            self.teacher_dtype,
        )
        return embeddings, latents, negative, teacher

    def make_student(self, teacher: GuidedTeacher) -> torch.nn.Module:
        cfg = self.cfg
        if cfg.student_init in ("random", "teacher"):
            student = build_student(self.student_config, seed=cfg.seed)
            if cfg.student_init == "teacher":
                source = teacher.high if cfg.student_init_expert == "high" else teacher.low
                report = init_student_from_teacher(student, source)
                logger.info(
                    "student initialised from the %s-noise expert: %s", cfg.student_init_expert, report
                )
        else:
            student = load_pretrained_student(cfg.student_init, self.info.expert_config)
        if cfg.gradient_checkpointing:
            student.enable_gradient_checkpointing()
        return student.to(self.device).train()

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this run."""
        identity = {
            "student_config": self.student_config,
            "teacher": self.info.fingerprint("transformer", "transformer_2"),
            "num_prompts": len(self.prompts),
        }
        return json.loads(json.dumps(identity))  # as it reads back from meta.json (tuples become lists)

    # -- training --------------------------------------------------------------------------
    def run(self) -> RunResult:
        cfg = self.cfg
        out = prepare_output_dir(cfg)
        save_resolved_config(cfg, out / "run_config.json")
        result = RunResult(output_dir=out, steps=0)
        logger.info("plan:\n%s", self.plan())
        embeddings, latents, negative, teacher = self.prepare_caches(result)
        dataset = DistillationDataset(self.prompts, latents, embeddings, cfg.max_sequence_length)
        student = self.make_student(teacher)
        loop = TrainingLoop(cfg, self, student, teacher, dataset, negative, out)
        result.resumed_from = loop.maybe_resume()
        loop.train(result)
        result.student_dir, result.ema_dir = loop.export()
        return result


class TrainingLoop:
    """Optimizer, schedule, EMA, checkpoints and the step itself."""

    def __init__(
        self,
        cfg: TrainConfig,
        distiller: Distiller,
        student: torch.nn.Module,
        teacher: GuidedTeacher,
        dataset: DistillationDataset,
        negative: torch.Tensor,
        output_dir: Path,
    ) -> None:
        from diffusers.optimization import get_scheduler

        self.cfg, self.distiller = cfg, distiller
        self.student, self.teacher = student, teacher
        self.device = distiller.device
        self.output_dir = output_dir
        self.negative = negative.to(self.device, torch.float32)[None]
        self.negative = torch.nn.functional.pad(
            self.negative, (0, 0, 0, cfg.max_sequence_length - negative.shape[0])
        )
        samples_per_step = cfg.batch_size * cfg.gradient_accumulation_steps
        if cfg.num_steps is not None:
            self.total_steps = cfg.num_steps
        else:
            self.total_steps = cfg.num_epochs * math.ceil(len(dataset) / samples_per_step)
        self.sampler = ResumableSampler(len(dataset), cfg.seed)
        self.dataset = dataset
        params = [p for p in student.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=self.device.type == "cuda"
        )
        name = "cosine" if cfg.lr_scheduler == "cosine" else "constant_with_warmup"
        self.lr_schedule = get_scheduler(
            name, self.optimizer, num_warmup_steps=cfg.lr_warmup_steps, num_training_steps=self.total_steps
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.mixed_precision == "fp16")
        self.ema = None
        if cfg.ema_decay:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(params, decay=cfg.ema_decay)
        # Our own generators: the random stream of training is then part of the checkpoint.
        self.timestep_generator = torch.Generator("cpu").manual_seed(cfg.seed + 1)
        self.noise_generator = torch.Generator(self.device).manual_seed(cfg.seed + 2)
        self.step = 0
        self.consumed = 0  # samples drawn by this rank
        self.wandb_run_id: str | None = None
        self.faults = FaultInjector(rank=0)

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_schedule": self.lr_schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "timestep_generator": self.timestep_generator.get_state(),
            "noise_generator": self.noise_generator.get_state(),
            "rng": ckpt.rng_state(),
        }

    def save(self) -> Path:
        meta = {
            "consumed": self.consumed,
            "identity": self.distiller.identity(),
            "wandb_run_id": self.wandb_run_id,
        }
        path = ckpt.save_checkpoint(
            ckpt.checkpoint_root(self.output_dir),
            self.step,
            self.student.state_dict(),
            self.checkpoint_state(),
            meta,
            self.cfg.keep_last,
        )
        logger.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> Path | None:
        cfg = self.cfg
        if cfg.resume == "none":
            return None
        root = ckpt.checkpoint_root(self.output_dir)
        found = ckpt.load_latest(root) if cfg.resume == "auto" else ckpt.load_checkpoint(Path(cfg.resume))
        if found is None:
            return None
        expected = self.distiller.identity()
        for key, value in expected.items():
            saved = found.meta["identity"].get(key)
            if saved != value:
                if isinstance(value, dict) and isinstance(saved, dict):
                    keys = sorted(k for k in set(saved) | set(value) if saved.get(k) != value.get(k))
                    saved, value = {k: saved.get(k) for k in keys}, {k: value.get(k) for k in keys}
                raise DistillError(
                    f"checkpoint {found.path} was made with a different {key.replace('_', ' ')}",
                    f"checkpoint: {saved}\nthis run:   {value}",
                    fixes=[
                        "resume with the settings the checkpoint was made with",
                        "or start fresh: another --output_dir, or --resume none",
                    ],
                    stage=Stage.CHECKPOINT,
                )
        self.student.load_state_dict(found.model)
        state = found.state
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        self.timestep_generator.set_state(state["timestep_generator"])
        self.noise_generator.set_state(state["noise_generator"])
        ckpt.restore_rng_state(state["rng"])
        self.step, self.consumed = found.step, int(found.meta["consumed"])
        self.wandb_run_id = found.meta.get("wandb_run_id")
        logger.info("resumed from %s (step %d)", found.path, self.step)
        return found.path

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.mixed_precision == "no":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def micro_step(self, batch: dict[str, torch.Tensor], sums: torch.Tensor) -> None:
        """Forward and backward of one micro-batch; adds [loss, high loss, high n, low loss, low n] to `sums`."""
        x0 = batch["x0"].to(self.device, non_blocking=True)
        cond = batch["cond"].to(self.device, non_blocking=True)
        sigmas = sample_sigmas(x0.shape[0], self.distiller.shift, self.timestep_generator)
        timesteps = sigmas_to_timesteps(sigmas)
        noise = torch.randn(x0.shape, generator=self.noise_generator, device=self.device, dtype=x0.dtype)
        x_t = add_noise(x0, noise, sigmas)
        target = self.teacher.velocity(x_t, timesteps, cond, self.negative)
        with self.autocast():
            prediction = self.student(
                hidden_states=x_t,
                timestep=timesteps.to(self.device),
                encoder_hidden_states=cond,
                return_dict=False,
            )[0]
        losses = per_sample_mse(prediction, target)
        loss = losses.mean() / self.cfg.gradient_accumulation_steps
        self.scaler.scale(loss).backward()
        high = high_noise_mask(timesteps, self.teacher.boundary_ratio).to(self.device, torch.float32)
        detached = losses.detach()
        sums += torch.stack(
            [
                detached.sum(),
                (detached * high).sum(),
                high.sum(),
                (detached * (1 - high)).sum(),
                (1 - high).sum(),
            ]
        )

    def optimizer_step(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.cfg.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in params if p.grad is not None])
            )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(params)
        return grad_norm

    def train(self, result: RunResult) -> None:
        cfg = self.cfg
        self.sampler.start_at(self.consumed)
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            num_workers=cfg.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
        )
        batches = iter(loader)
        tracker = Tracker(
            self.output_dir,
            self.distiller.is_main,
            self.total_steps,
            self.step,
            cfg.wandb_project,
            cfg.wandb_mode,
            cfg.wandb_run_name,
            self.wandb_run_id,
            cfg.to_dict(),
        )
        self.wandb_run_id = tracker.wandb_run_id
        sums = torch.zeros(5, device=self.device)
        try:
            while self.step < self.total_steps:
                self.faults.before_step(self.step + 1)
                for _ in range(cfg.gradient_accumulation_steps):
                    self.micro_step(next(batches), sums)
                    self.consumed += cfg.batch_size
                grad_norm = self.optimizer_step()
                self.step += 1
                tracker.advance()
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    metrics = self.metrics(sums, grad_norm)  # the one host sync of a logged step
                    sums.zero_()
                    tracker.log(self.step, metrics)
                    result.history.append({"step": self.step, **metrics})
                    if result.first_loss is None:
                        result.first_loss = metrics["loss"]
                    result.last_loss = metrics["loss"]
                if (
                    cfg.checkpoint_every
                    and self.step % cfg.checkpoint_every == 0
                    and self.step < self.total_steps
                ):
                    self.save()
            self.save()
        finally:
            tracker.close()
        result.steps = self.step

    def metrics(self, sums: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, float]:
        total, high_loss, high_n, low_loss, low_n, norm = torch.cat(
            [sums, grad_norm.reshape(1).float()]
        ).tolist()
        metrics = {
            "loss": total / max(high_n + low_n, 1),
            "lr": self.lr_schedule.get_last_lr()[0],
            "grad_norm": norm,
        }
        if high_n:
            metrics["loss_high_noise"] = high_loss / high_n
        if low_n:
            metrics["loss_low_noise"] = low_loss / low_n
        return metrics

    # -- export ------------------------------------------------------------------------------
    def export(self) -> tuple[Path, Path | None]:
        student_dir = export_student(self.student, self.output_dir / "student")
        ema_dir = None
        if self.ema is not None:
            params = list(self.student.parameters())
            self.ema.store(params)
            self.ema.copy_to(params)
            try:
                ema_dir = export_student(self.student, self.output_dir / "student_ema")
            finally:
                self.ema.restore(params)
        return student_dir, ema_dir
