"""The distillation run: prepare caches, train the student on the teacher's guided velocities, export.

One step: draw clean latents x0 from the cache, fresh noise and timesteps, form x_t, ask the
teacher experts (routed by t, with guidance) for the target velocity, regress the student onto
it with MSE. Under torchrun the student is wrapped in DDP; each rank handles its slice of one
global batch, so the result does not depend on how many processes share it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from distill import checkpoint as ckpt
from distill import distributed as dist_utils
from distill import watchdog
from distill.config import TrainConfig, save_resolved_config
from distill.data import DistillationDataset, ResumableSampler, TensorCache, read_prompts
from distill.distributed import DistContext
from distill.errors import DistillError, Progress, Stage
from distill.faults import FaultInjector
from distill.model_card import document_export
from distill.monitor import SampleMonitor, SampleSettings
from distill.objective import add_noise, high_noise_mask, per_sample_mse, sample_sigmas, sigmas_to_timesteps
from distill.original_layout import check_original_exportable, export_original
from distill.plan import choose_placement, memory_plan
from distill.prepare import embedding_cache, fill_embedding_cache, fill_latent_cache, latent_cache
from distill.run_settings import settings_from_run
from distill.student import (
    build_student,
    export_student,
    init_student_from_teacher,
    load_pretrained_student,
    load_student_config,
    unwrap_model,
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


def available_host_memory() -> int:
    """Free host RAM in bytes (what a new allocation can use without swapping)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62  # unknown: do not stagger


logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@dataclass
class RunResult:
    """What a finished run produced, for the entry point to print and tests to check."""

    output_dir: Path
    steps: int = 0
    student_dir: Path | None = None
    ema_dir: Path | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    embeddings_built: int = 0
    latents_built: int = 0
    resumed_from: Path | None = None
    stopped_by_signal: str | None = None
    bad_steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Checks before any heavy work
# ---------------------------------------------------------------------------------------------


def check_resolution(cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any]) -> None:
    """Refuse a training size the teacher or the student cannot denoise (see check_sample_size)."""
    from distill.sampling import SizeLimits, check_sample_size

    check_sample_size(
        cfg.height,
        cfg.width,
        cfg.num_frames,
        info.vae_scale_spatial,
        info.vae_scale_temporal,
        [
            SizeLimits.of("teacher", info.expert_config, info.path / "transformer" / "config.json"),
            SizeLimits.of("student", student_config, cfg.student_config),
        ],
    )


def prepare_output_dir(cfg: TrainConfig) -> Path:
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{id(cfg)}"
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

    def __init__(self, cfg: TrainConfig, ctx: DistContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx if ctx is not None else dist_utils.setup("auto", cfg.device)
        self.device = self.ctx.device
        self.is_main = self.ctx.is_main
        # An original-layout teacher is converted once, next to the run's cache (storage all ranks share).
        self.info = inspect_teacher(
            cfg.teacher_path, cfg.boundary_ratio, convert_dir=cfg.resolved_cache_dir / "teacher"
        )
        # Refuse a student that cannot work with this teacher before loading anything heavy.
        self.student_config = load_student_config(cfg.student_config, self.info.expert_config)
        if "original" in cfg.export_formats.split(","):  # refused now, not after training
            check_original_exportable(
                self.student_config,
                f"the student of {cfg.student_config} (--export_formats original)",
                Stage.CONFIG,
            )
        check_resolution(cfg, self.info, self.student_config)
        self.prompts = read_prompts(cfg.data_path)[: cfg.max_prompts]
        self.teacher_dtype = resolve_dtype(cfg.teacher_dtype, self.device)
        self.shift = cfg.flow_shift if cfg.flow_shift is not None else self.info.flow_shift
        self.placement, self.placement_reason = choose_placement(
            cfg, self.info, self.student_config, self.device, self.ctx.world_size
        )
        self.early_student: torch.nn.Module | None = None
        self._identity: dict[str, Any] | None = None
        # Reads the sample/eval prompt files now, so a bad path fails before anything heavy loads.
        settings = SampleSettings.from_config(cfg)
        settings.validate()
        self.monitor = SampleMonitor(
            settings,
            self.info,
            cfg.output_dir,
            self.device,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            barrier=dist_utils.barrier,
        )

    def plan(self) -> str:
        world = self.cfg.plan_world_size or self.ctx.world_size
        local_world = min(
            world, int(os.environ.get("LOCAL_WORLD_SIZE", 8 if self.cfg.plan_world_size else 1))
        )
        placement = (self.placement, self.placement_reason)
        if self.cfg.plan_world_size and self.cfg.plan_world_size != self.ctx.world_size:
            placement = choose_placement(self.cfg, self.info, self.student_config, self.device, world)
        return memory_plan(
            self.cfg,
            self.info,
            self.student_config,
            self.device,
            world,
            local_world,
            chosen=placement,
        )

    # -- preparation -----------------------------------------------------------------------
    def _open_shared(self, make_cache: Any) -> TensorCache:
        """Rank 0 creates the cache folder and its settings first; the others then check them."""
        cache = make_cache() if self.is_main else None
        dist_utils.barrier()
        return cache if cache is not None else make_cache()

    def _require_complete(self, cache: TensorCache, prompts: list[str]) -> None:
        missing = cache.missing(prompts)
        if missing:
            raise DistillError(
                f"the {cache.what} cache {cache.folder} lacks {len(missing)} entr(y/ies) after every rank built its share",
                f"first missing prompt: {missing[0]!r}",
                causes=[
                    "another rank failed while building its share",
                    "ranks see different --cache_dir contents",
                ],
                fixes=["put --cache_dir on storage every rank shares", "rerun: finished entries are kept"],
                stage=Stage.DATA,
            )

    def prepare_caches(
        self, result: RunResult
    ) -> tuple[TensorCache, TensorCache, torch.Tensor, GuidedTeacher]:
        cfg, rank, world = self.cfg, self.ctx.rank, self.ctx.world_size
        Progress.enter(Stage.DATA)
        everything = list(dict.fromkeys([*self.prompts, cfg.negative_prompt, *self.monitor.prompts]))
        embeddings = self._open_shared(lambda: embedding_cache(cfg, self.info, self.teacher_dtype))
        result.embeddings_built = fill_embedding_cache(
            embeddings,
            everything[rank::world],
            self.info,
            cfg.max_sequence_length,
            self.device,
            self.teacher_dtype,
            show_progress=self.is_main,
        )
        dist_utils.barrier()
        self._require_complete(embeddings, everything)
        negative = embeddings.get(cfg.negative_prompt)

        Progress.enter(Stage.TEACHER_LOAD)
        high, low = self.load_teacher_experts()
        Progress.enter(Stage.DATA)
        latents = self._open_shared(lambda: latent_cache(cfg, self.info, self.teacher_dtype, embeddings))
        result.latents_built = fill_latent_cache(
            latents,
            self.prompts[rank::world],
            embeddings,
            negative,
            cfg,
            self.info,
            high,
            low,
            self.device,
            self.is_main,
            lockstep_placeholder=self.prompts[0] if self.placement == "shard" else None,
        )
        dist_utils.barrier()
        self._require_complete(latents, self.prompts)
        teacher = GuidedTeacher(
            high,
            low,
            self.info.boundary_ratio,
            cfg.guidance_scale,
            cfg.guidance_scale_2,
            self.device,
            self.teacher_dtype,
            lockstep=self.placement == "shard",
        )
        return embeddings, latents, negative, teacher

    def teacher_load_waves(self) -> int:
        """How many groups of this node's ranks load the experts one after the other.

        Each rank reads an expert into host RAM before moving it to its GPU. Eight ranks doing that
        at once with 28 GB experts is how nodes get SIGKILLed by the OOM killer without a word, so
        ranks load in waves sized to the free host memory (--teacher_load_concurrency overrides).
        """
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.cfg.teacher_load_concurrency:
            per_wave = self.cfg.teacher_load_concurrency
        else:
            bytes_per_rank = self.info.expert_bytes(self.teacher_dtype)
            per_wave = max(1, int(0.8 * available_host_memory() // max(bytes_per_rank, 1)))
        return math.ceil(local_world / min(per_wave, local_world))

    def load_teacher_experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        cfg, device = self.cfg, self.device
        local_rank, waves = self.ctx.local_rank, self.teacher_load_waves()
        per_wave = math.ceil(int(os.environ.get("LOCAL_WORLD_SIZE", "1")) / waves)
        experts: tuple[torch.nn.Module, torch.nn.Module] | None = None
        for wave in range(waves):  # every rank passes every barrier, loading in its own wave
            if local_rank // per_wave == wave:
                if waves > 1:
                    logger.warning("loading the teacher experts (wave %d of %d)", wave + 1, waves)
                high = load_expert(self.info, "transformer", self.teacher_dtype)
                low = load_expert(self.info, "transformer_2", self.teacher_dtype)
                if cfg.student_init == "teacher":  # before placement: a sharded expert has no whole tensors
                    self.early_student = self.init_from_teacher(
                        high if cfg.student_init_expert == "high" else low
                    )
                shard_over = self.ctx.world_size if self.placement == "shard" else 0
                on_cpu = self.placement == "cpu"
                experts = (
                    place_expert(high, device, on_cpu, shard_over),
                    place_expert(low, device, on_cpu, shard_over),
                )
            if waves > 1:
                dist_utils.barrier()
        assert experts is not None
        return experts

    def init_from_teacher(self, expert: torch.nn.Module) -> torch.nn.Module:
        student = build_student(self.student_config, seed=self.cfg.seed)
        report = init_student_from_teacher(student, expert)
        logger.info("student initialised from the %s-noise expert: %s", self.cfg.student_init_expert, report)
        return student

    def make_student(self) -> torch.nn.Module:
        cfg = self.cfg
        if cfg.student_init == "teacher":
            student = self.early_student
        elif cfg.student_init == "random":
            student = build_student(self.student_config, seed=cfg.seed)
        else:
            student = load_pretrained_student(cfg.student_init, self.info.expert_config)
        if cfg.gradient_checkpointing:
            student.enable_gradient_checkpointing()
        return student.to(self.device).train()

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this run (computed once: every save
        stores it, and the teacher fingerprint reads the weight files)."""
        if self._identity is not None:
            return self._identity
        identity = {
            "student_config": self.student_config,
            "teacher": self.info.fingerprint("transformer", "transformer_2"),
            "prompts": hashlib.sha256("\n".join(self.prompts).encode()).hexdigest()[:16],
            # What the student regresses onto: another value is another objective (as resolved,
            # so --flow_shift 3.0 equals a teacher default of 3.0). Keys are the option names.
            "target": {
                "guidance_scale": self.cfg.guidance_scale,
                "guidance_scale_2": self.cfg.guidance_scale_2,
                "negative_prompt": self.cfg.negative_prompt,
                "flow_shift": self.shift,
                "boundary_ratio": self.info.boundary_ratio,
                "max_sequence_length": self.cfg.max_sequence_length,
            },
        }
        self._identity = json.loads(
            json.dumps(identity)
        )  # as it reads back from meta.json (tuples become lists)
        return self._identity

    def check_checkpoint(self, path: Path, meta: dict[str, Any]) -> None:
        """Refuse to resume a checkpoint made for another student, teacher or prompt set (unless forced)."""
        expected = self.identity()
        for key, value in expected.items():
            saved = meta.get("identity", {}).get(key)
            if saved == value:
                continue
            if key == "target" and saved is None:
                logger.warning("checkpoint %s does not record its training target; not checked", path)
                continue
            if isinstance(value, dict) and isinstance(saved, dict):
                keys = sorted(k for k in set(saved) | set(value) if saved.get(k) != value.get(k))
                saved, value = {k: saved.get(k) for k in keys}, {k: value.get(k) for k in keys}
            what = key.replace("_", " ")
            if key == "target":  # name the options that changed
                what = "training target: " + ", ".join(f"--{k}" for k in value)
            if self.cfg.force_resume:
                logger.warning(
                    "resuming %s although it was made with a different %s (--force_resume)", path, what
                )
                continue
            raise DistillError(
                f"checkpoint {path} was made with a different {what}",
                f"checkpoint: {saved}\nthis run:   {value}",
                fixes=[
                    "resume with the settings the checkpoint was made with",
                    "or start fresh in another --output_dir",
                    "or pass --force_resume if the change is intended (the weights are loaded as they are)",
                ],
                stage=Stage.CHECKPOINT,
            )

    def check_output_dir(self) -> None:
        """Before any heavy work: never overwrite another run's checkpoints, never resume a foreign one."""
        complete = ckpt.complete_checkpoints(ckpt.checkpoint_root(self.cfg.output_dir))
        if self.cfg.resume == "none":
            if complete:
                raise DistillError(
                    f"--output_dir {self.cfg.output_dir} already holds checkpoints (newest: {complete[-1].name})",
                    "--resume none would start over and then overwrite and prune them.",
                    fixes=[
                        "continue that run: --resume auto",
                        "or start this one in another --output_dir",
                        f"or delete {ckpt.checkpoint_root(self.cfg.output_dir)} if it is no longer needed",
                    ],
                    stage=Stage.CHECKPOINT,
                )
            return
        candidate = (
            Path(self.cfg.resume) if self.cfg.resume != "auto" else (complete[-1] if complete else None)
        )
        if candidate is not None and (candidate / "meta.json").is_file():
            self.check_checkpoint(candidate, json.loads((candidate / "meta.json").read_text()))

    # -- training --------------------------------------------------------------------------
    def run(self) -> RunResult:
        cfg = self.cfg
        self.check_output_dir()
        out = prepare_output_dir(cfg)
        if self.is_main:
            save_resolved_config(cfg, out / "run_config.json")
            logger.info("plan:\n%s", self.plan())
        result = RunResult(output_dir=out)
        embeddings, latents, negative, teacher = self.prepare_caches(result)
        dataset = DistillationDataset(self.prompts, latents, embeddings, cfg.max_sequence_length)
        student = self.make_student()
        loop = TrainingLoop(cfg, self, student, teacher, dataset, negative, out)
        result.resumed_from = loop.maybe_resume()
        loop.train(result)
        if result.stopped_by_signal is None:
            result.student_dir, result.ema_dir = loop.export()
        # No rank leaves before rank 0 has finished writing: under torchrun the first rank to exit
        # with a non-zero code (75 after a preemption) makes the agent stop the others.
        dist_utils.barrier()
        return result


class StopRequest:
    """Remembers a preemption signal so every rank can stop together at the next step boundary."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            # Outside the main thread signals stay with whoever owns them.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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

        self.cfg, self.distiller, self.ctx = cfg, distiller, distiller.ctx
        self.teacher, self.dataset = teacher, dataset
        self.device = distiller.device
        self.output_dir = output_dir
        self.student = student
        self.model = student  # what the step calls: the DDP wrapper under torchrun
        if self.ctx.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(student, device_ids=device_ids)
        padded = torch.zeros(1, cfg.max_sequence_length, negative.shape[-1])
        padded[0, : negative.shape[0]] = negative[: cfg.max_sequence_length]
        self.negative = padded.to(self.device)
        global_samples_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * self.ctx.world_size
        if cfg.num_steps is not None:
            self.total_steps = cfg.num_steps
        else:
            self.total_steps = cfg.num_epochs * math.ceil(len(dataset) / global_samples_per_step)
        self.sampler = ResumableSampler(
            len(dataset), cfg.seed, cfg.batch_size, self.ctx.rank, self.ctx.world_size
        )
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
        # Randomness of the GLOBAL batch, identical on every rank; each rank uses its slice. Our
        # own generators, so the random stream of training is part of the checkpoint.
        self.timestep_generator = torch.Generator("cpu").manual_seed(cfg.seed + 1)
        self.noise_generator = torch.Generator(self.device).manual_seed(cfg.seed + 2)
        self.step = 0
        self.consumed = 0  # global samples drawn
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss or gradient
        self.skipped_steps = 0
        self.overflowed = False  # the last step was an fp16 overflow the grad scaler skipped
        self.wandb_run_id: str | None = None
        self.faults = FaultInjector(rank=self.ctx.rank)

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

    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint; every rank learns whether it worked and stops together if not."""
        Progress.enter(Stage.CHECKPOINT, self.step)
        watchdog.pause()  # saves, samples and evaluations may take long: not watched
        error: DistillError | None = None
        path = None
        if self.ctx.is_main:
            meta = {
                "consumed": self.consumed,
                "identity": self.distiller.identity(),
                "wandb_run_id": self.wandb_run_id,
                "world_size": self.ctx.world_size,
                "skipped_steps": self.skipped_steps,
            }
            try:
                path = ckpt.save_checkpoint(
                    ckpt.checkpoint_root(self.output_dir),
                    self.step,
                    unwrap_model(self.student).state_dict(),
                    self.checkpoint_state(),
                    meta,
                    self.cfg.keep_last,
                )
                logger.info("saved checkpoint %s", path)
            except DistillError as exc:
                error = exc
        if dist_utils.any_rank(error is not None, self.device):
            raise error or DistillError(
                "rank 0 could not write a checkpoint; stopping with it", stage=Stage.CHECKPOINT
            )
        return path

    def maybe_resume(self) -> Path | None:
        cfg = self.cfg
        if cfg.resume == "none":
            return None
        root = ckpt.checkpoint_root(self.output_dir)
        found = ckpt.load_latest(root) if cfg.resume == "auto" else ckpt.load_checkpoint(Path(cfg.resume))
        if found is None:
            return None
        self.distiller.check_checkpoint(found.path, found.meta)
        unwrap_model(self.student).load_state_dict(found.model)
        state = found.state
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state["ema"] is not None:
            ckpt.restore_ema(self.ema, state["ema"], self.device)
        self.timestep_generator.set_state(state["timestep_generator"])
        self.noise_generator.set_state(state["noise_generator"].to(self.noise_generator.get_state().device))
        ckpt.restore_rng_state(state["rng"])
        self.step, self.consumed = found.step, int(found.meta["consumed"])
        self.skipped_steps = int(found.meta.get("skipped_steps", 0))
        self.wandb_run_id = found.meta.get("wandb_run_id")
        if self.ctx.is_main:
            logger.info("resumed from %s (step %d)", found.path, self.step)
        return found.path

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.mixed_precision == "no":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _global_randomness(
        self, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[bool, bool]]:
        """Sigmas (CPU) and noise (device) of this rank's slice of the global micro-batch, and whether
        any rank needs the high / low expert (known everywhere: the global sigmas are)."""
        world, rank = self.ctx.world_size, self.ctx.rank
        batch = shape[0]
        sigmas = sample_sigmas(batch * world, self.distiller.shift, self.timestep_generator)
        noise = torch.randn((batch * world, *shape[1:]), generator=self.noise_generator, device=self.device)
        rows = slice(rank * batch, (rank + 1) * batch)
        high = high_noise_mask(sigmas_to_timesteps(sigmas), self.teacher.boundary_ratio)
        return sigmas[rows], noise[rows], (bool(high.any()), bool((~high).any()))

    def micro_step(
        self, batch: dict[str, torch.Tensor], sums: torch.Tensor, sync: bool, poison: bool
    ) -> None:
        """Forward and backward of one micro-batch; adds [loss, high loss, high n, low loss, low n] to `sums`
        (this step's sums: they join the logged totals only if the step is not skipped)."""
        x0 = batch["x0"].to(self.device, non_blocking=True)
        # The cache keeps embeddings in the teacher's dtype; the student computes in float32 (or autocast).
        cond = batch["cond"].to(self.device, torch.float32, non_blocking=True)
        sigmas, noise, experts_needed = self._global_randomness(tuple(x0.shape))
        timesteps = sigmas_to_timesteps(sigmas)
        # Non-blocking copies of the small CPU tensors: a blocking one waits for every queued kernel
        # (the previous step's optimizer, then the teacher), leaving the GPU idle while the host
        # catches up with its kernel launches.
        timesteps_device = timesteps.to(self.device, non_blocking=True)
        x_t = add_noise(x0, noise.to(x0.dtype), sigmas.to(self.device, torch.float32, non_blocking=True))
        target = self.teacher.velocity(x_t, timesteps, cond, self.negative, experts_needed)
        no_sync = self.model.no_sync if (self.ctx.enabled and not sync) else contextlib.nullcontext
        with no_sync():
            with self.autocast():
                prediction = self.model(
                    hidden_states=x_t,
                    timestep=timesteps_device,
                    encoder_hidden_states=cond,
                    return_dict=False,
                )[0]
            losses = per_sample_mse(prediction, target)
            if poison:  # DISTILL_INJECT_FAULT=nan:STEP
                losses = losses * float("nan")
            loss = losses.mean() / self.cfg.gradient_accumulation_steps
            self.scaler.scale(loss).backward()
        high = high_noise_mask(timesteps_device, self.teacher.boundary_ratio).float()
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

    def optimizer_step(
        self, step_loss: torch.Tensor, stop_requested: bool
    ) -> tuple[torch.Tensor, bool, bool]:
        """Clip and step, unless loss or gradient is non-finite. Returns (grad norm, stepped, stop on all ranks)."""
        self.scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        bad = ~torch.isfinite(step_loss)
        # With fp16, non-finite gradients under a finite loss are an overflow of the loss scale:
        # the scaler skips the update (it saw the same infs in unscale_) and lowers the scale.
        overflow = ~torch.isfinite(grad_norm) & ~bad
        if not self.scaler.is_enabled():
            bad, overflow = bad | overflow, torch.zeros_like(overflow)
        # The one per-step host sync: a bad step must be skipped on every rank alike, and a
        # preemption signal on any rank must stop all of them at the same step, so the flags are
        # reduced across ranks in one small collective before anything is updated.
        flags = torch.stack(
            [bad.float(), overflow.float(), torch.full((), float(stop_requested), device=self.device)]
        )
        if self.ctx.enabled:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        non_finite, overflowed, stop = (bool(v) for v in flags.tolist())
        self.overflowed = overflowed and not non_finite
        if non_finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            return grad_norm, False, stop
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.overflowed:  # no update was made: the LR schedule and the EMA do not advance either
            return grad_norm, False, stop
        self.lr_schedule.step()
        if self.ema is not None:
            self.ema.step(params)
        return grad_norm, True, stop

    def train_step(
        self,
        batches: Iterator[dict[str, torch.Tensor]],
        step_sums: torch.Tensor,
        stop: StopRequest | None = None,
    ) -> tuple[torch.Tensor, bool, bool]:
        """One optimizer step over `gradient_accumulation_steps` micro-batches; see optimizer_step.

        `stop` is read just before the update, so a signal that arrives during the step stops at it.
        """
        cfg = self.cfg
        next_step = self.step + 1
        Progress.enter(Stage.TRAINING, next_step)
        watchdog.beat(Stage.TRAINING, next_step)  # a step must finish within --stall_timeout
        self.faults.before_step(next_step)
        step_sums.zero_()
        for micro in range(cfg.gradient_accumulation_steps):
            last = micro == cfg.gradient_accumulation_steps - 1
            self.micro_step(next(batches), step_sums, sync=last, poison=self.faults.wants_nan(next_step))
            self.consumed += cfg.batch_size * self.ctx.world_size
        outcome = self.optimizer_step(step_sums[0], stop is not None and stop.signal_name is not None)
        self.step = next_step
        return outcome

    def make_loader(self) -> torch.utils.data.DataLoader:
        """Batches of this rank, starting after the samples already consumed."""
        self.sampler.start_at(self.consumed)
        return torch.utils.data.DataLoader(
            self.dataset,
            batch_size=self.cfg.batch_size,
            sampler=self.sampler,
            num_workers=self.cfg.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=self.cfg.num_workers > 0,
        )

    def train(self, result: RunResult) -> None:
        cfg = self.cfg
        batches = iter(self.make_loader())
        tracker = Tracker(
            self.output_dir,
            self.ctx.is_main,
            self.total_steps,
            self.step,
            cfg.wandb_project,
            cfg.wandb_mode,
            cfg.wandb_run_name,
            self.wandb_run_id,
            cfg.to_dict(),
        )
        self.wandb_run_id = tracker.wandb_run_id
        monitor = self.distiller.monitor
        tracker.log_media(
            self.step,
            monitor.start(self.teacher.high, self.teacher.low, self.dataset.embeddings, self.negative),
        )
        sums = torch.zeros(5, device=self.device)
        step_sums = torch.zeros(5, device=self.device)
        try:
            with StopRequest() as stop:
                while self.step < self.total_steps:
                    grad_norm, stepped, stop_now = self.train_step(batches, step_sums, stop)
                    tracker.advance()
                    if stepped or self.overflowed:  # an fp16 overflow's loss is finite: it counts
                        sums += step_sums
                    if stepped:
                        self.bad_steps = 0
                    elif self.overflowed:
                        self._count_overflow(result)
                    else:
                        self._count_bad_step(result)
                    if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                        self._log(sums, grad_norm, tracker, result, skipped=not stepped)
                        if self.ctx.is_main:
                            monitor.plot_loss(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png")
                    self._observe(monitor, tracker)
                    if stop_now:
                        result.stopped_by_signal = stop.signal_name or "a signal on another rank"
                        logger.warning(
                            "stop requested (%s): saving a checkpoint at step %d and exiting",
                            result.stopped_by_signal,
                            self.step,
                        )
                        break
                    due = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                    # Not in the middle of a run of skipped steps: pruning would then drop good checkpoints.
                    if due and self.step < self.total_steps and self.bad_steps == 0:
                        self.save()
                self.save()
            if result.stopped_by_signal is None:
                self._observe(monitor, tracker, final=True)
            self.check_ranks_agree()
        finally:
            tracker.close()
        result.steps = self.step

    def _observe(self, monitor: SampleMonitor, tracker: Tracker, final: bool = False) -> None:
        """Samples and the student-vs-teacher report when due (every rank takes part), logged on rank 0."""
        Progress.enter(Stage.TRAINING, self.step)
        watchdog.pause()
        force_samples = final and monitor.settings.save_samples and not monitor.samples_due(self.step)
        files = monitor.after_step(self.step, self.student, self.ema, force=force_samples)
        report = monitor.evaluate(self.step, self.student, self.ema)
        tracker.log_media(
            self.step, files + (report.files if report else []), report.metrics if report else None
        )
        if final and self.ctx.is_main:
            monitor.plot_loss(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png", force=True)

    def check_ranks_agree(self) -> None:
        """At the end of a data-parallel run, prove every rank ended with the same student."""
        if not self.ctx.enabled:
            return
        agree, digest = dist_utils.ranks_agree(unwrap_model(self.student), self.device)
        if not agree:
            raise DistillError(
                "the ranks ended with different student weights",
                "DDP keeps replicas identical; a difference means a rank skipped or repeated an update.",
                fixes=["report this with the command line; the rank-0 checkpoint is the one to keep"],
                stage=Stage.TRAINING,
            )
        if self.ctx.is_main:
            logger.info(
                "all %d ranks hold identical student weights (checksum %s)", self.ctx.world_size, digest
            )

    def _count_overflow(self, result: RunResult) -> None:
        """An fp16 overflow: skipped and counted, but not a bad step (the scaler recovers by itself)."""
        self.skipped_steps += 1
        result.bad_steps = self.skipped_steps
        if self.ctx.is_main:
            logger.info(
                "step %d skipped: fp16 gradient overflow, loss scale lowered to %g",
                self.step,
                self.scaler.get_scale(),
            )

    def _count_bad_step(self, result: RunResult) -> None:
        self.bad_steps += 1
        self.skipped_steps += 1
        result.bad_steps = self.skipped_steps
        if self.ctx.is_main:
            logger.warning(
                "step %d skipped: non-finite loss or gradient (%d in a row, limit --max_bad_steps %d)",
                self.step,
                self.bad_steps,
                self.cfg.max_bad_steps,
            )
        if self.bad_steps >= self.cfg.max_bad_steps:
            last = ckpt.complete_checkpoints(ckpt.checkpoint_root(self.output_dir))
            raise DistillError(
                f"{self.bad_steps} consecutive steps had a non-finite loss or gradient (step {self.step})",
                "Training stopped without saving, so the last good checkpoint is kept as it is: "
                + (str(last[-1]) if last else "none was written yet"),
                causes=[
                    "learning rate too high",
                    "fp16 overflow (try --mixed_precision bf16)",
                    "corrupt cached latents",
                ],
                fixes=[
                    "lower --lr or raise --lr_warmup_steps, then rerun with --resume auto",
                    "use --mixed_precision bf16 instead of fp16",
                    "raise --max_bad_steps if occasional bad batches are expected",
                ],
                stage=Stage.TRAINING,
            )

    def _log(
        self,
        sums: torch.Tensor,
        grad_norm: torch.Tensor,
        tracker: Tracker,
        result: RunResult,
        skipped: bool = False,
    ) -> None:
        dist_utils.all_reduce_sum(sums)  # every rank reaches the same logged steps
        metrics = self.metrics(sums, grad_norm)  # the host sync of a logged step
        sums.zero_()
        metrics["skipped_steps"] = float(self.skipped_steps)
        if skipped:  # this step made no update (its grad_norm, if non-finite, is null)
            metrics["skipped"] = True
        tracker.log(self.step, metrics)
        result.history.append({"step": self.step, **metrics})
        if metrics["loss"] is not None:  # null when every step since the last row was skipped
            if result.first_loss is None:
                result.first_loss = metrics["loss"]
            result.last_loss = metrics["loss"]

    def metrics(self, sums: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, Any]:
        """Means over the steps counted since the last row; None (JSON null) where there is nothing
        to report, never a made-up 0.0: no counted sample, or a non-finite gradient norm."""
        total, high_loss, high_n, low_loss, low_n, norm = torch.cat(
            [sums, grad_norm.reshape(1).float()]
        ).tolist()
        metrics = {
            "loss": total / (high_n + low_n) if high_n + low_n else None,
            "lr": self.lr_schedule.get_last_lr()[0],
            "grad_norm": norm if math.isfinite(norm) else None,
        }
        if high_n:
            metrics["loss_high_noise"] = high_loss / high_n
        if low_n:
            metrics["loss_low_noise"] = low_loss / low_n
        return metrics

    # -- export ------------------------------------------------------------------------------
    def export(self) -> tuple[Path | None, Path | None]:
        """Rank 0 writes student/ (and student_ema/); the others wait for it."""
        student_dir = ema_dir = None
        if self.ctx.is_main:
            student = unwrap_model(self.student)
            student_dir = export_student(student, self.output_dir / "student")
            original = "original" in self.cfg.export_formats.split(",")
            if original:
                export_original(student_dir, self.output_dir / "student_original.safetensors")
            if self.ema is not None:
                params = list(student.parameters())
                self.ema.store(params)
                self.ema.copy_to(params)
                try:
                    ema_dir = export_student(student, self.output_dir / "student_ema")
                    if original:
                        export_original(ema_dir, self.output_dir / "student_ema_original.safetensors")
                finally:
                    self.ema.restore(params)
            # How the student samples (a method with its own sampler passes steps/scheduler here).
            settings = settings_from_run(self.cfg, self.distiller.info, self.step)
            pipeline_dir = self._write_pipeline_folder(ema_dir or student_dir, settings.scheduler)
            document_export(self.output_dir, settings, student_dir, ema_dir, pipeline_dir)
        dist_utils.barrier()
        return student_dir, ema_dir

    def _write_pipeline_folder(self, student_dir: Path, scheduler: dict[str, Any] | None) -> Path | None:
        """<output_dir>/pipeline/: WanPipeline.from_pretrained-ready, linking the teacher's parts (no copies)."""
        from distill.sampling import write_pipeline_folder

        try:
            path = write_pipeline_folder(self.output_dir, self.distiller.info.path, student_dir, scheduler)
            logger.info(
                "WanPipeline.from_pretrained(%r) loads the student with the teacher's text encoder and VAE "
                "(sample it as its README.md shows)",
                str(path),
            )
            return path
        except DistillError as exc:  # e.g. no symlinks on this file system: the student itself is fine
            logger.warning("no pipeline/ folder: %s (use python -m distill.generate instead)", exc.title)
            return None
