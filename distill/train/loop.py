"""The training loop every method shares: ranks, data order, accumulation, clipping, the
non-finite check, one optimizer and LR schedule per trained model, EMA, checkpoints, logging and
signals. What a finished run writes is distill/train/export.py.

What a step computes comes from the method (distill/train/methods/): velocity trains the student on
the teacher's guided velocities; dmd trains a few-step student and its critic. Under torchrun each
trained model is wrapped in DDP; each rank handles its slice of one global batch, so the result
does not depend on how many processes share it.

Longer than 500 lines because it is one class whose parts (step, optimizer step, checkpoint,
resume, logging) read and write the same run state; split across modules they would pass
that whole state back and forth.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from distill.config.settings import TrainConfig
from distill.data.dataset import DistillationDataset, ResumableSampler
from distill.models.guided_teacher import GuidedTeacher
from distill.models.lora import RoutedModel
from distill.models.student import unwrap_model
from distill.ops import distributed as dist_utils
from distill.ops import watchdog, workers
from distill.ops.errors import DistillError, Progress, Stage
from distill.ops.faults import FaultInjector
from distill.report.monitor import SampleMonitor
from distill.train import checkpoint as ckpt
from distill.train.identity import lora_flags, sample_record
from distill.train.methods import method_class
from distill.train.methods.base import BatchRandomness, MethodEnv
from distill.train.stop import StopRequest
from distill.train.tracking import Tracker

logger = logging.getLogger(__name__)


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
    conditions_built: int = 0  # image latents encoded (image to video)
    resumed_from: Path | None = None
    stopped_by_signal: str | None = None
    bad_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class TrainingLoop:
    """Optimizer, schedule, EMA, checkpoints and the step itself."""

    def __init__(
        self,
        cfg: TrainConfig,
        distiller: Any,  # distill.train.trainer.Distiller (or a stand-in, see distill.bench)
        student: torch.nn.Module,
        teacher: GuidedTeacher,
        dataset: DistillationDataset,
        negative: torch.Tensor,
        output_dir: Path,
        extra_models: dict[str, torch.nn.Module] | None = None,
    ) -> None:
        from diffusers.optimization import get_scheduler

        self.cfg, self.distiller, self.ctx = cfg, distiller, distiller.ctx
        self.teacher, self.dataset = teacher, dataset
        self.device = distiller.device
        self.output_dir = output_dir
        self.student = student
        # Every trained model (student first); the method decides which ones and how each learns.
        method_cls = method_class(cfg.method)
        self.models: dict[str, torch.nn.Module] = {"student": student, **(extra_models or {})}
        self.wrapped: dict[str, torch.nn.Module] = dict(self.models)  # what grad-carrying forwards call
        if self.ctx.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped = {
                # A model of two routed experts leaves one expert without gradient in a step whose
                # samples all fall on the other side of the boundary.
                name: DistributedDataParallel(
                    model, device_ids=device_ids, find_unused_parameters=isinstance(model, RoutedModel)
                )
                for name, model in self.models.items()
            }
        self.model = self.wrapped["student"]
        padded = torch.zeros(1, cfg.max_sequence_length, negative.shape[-1])
        padded[0, : negative.shape[0]] = negative[: cfg.max_sequence_length]
        self.negative = padded.to(self.device)
        # A context group (--sequence_parallel) reads one slice of the global batch together.
        global_samples_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * self.ctx.data_world
        if cfg.num_steps is not None:
            self.total_steps = cfg.num_steps
        else:
            self.total_steps = cfg.num_epochs * math.ceil(len(dataset) / global_samples_per_step)
        self.sampler = ResumableSampler(
            len(dataset), cfg.seed, cfg.batch_size, self.ctx.data_rank, self.ctx.data_world
        )
        self._latent_statistics: tuple[float, float] | None = None
        self._reference_motion: tuple[float | None] | None = None  # (value,) once read
        env = MethodEnv(
            teacher,
            self.negative,
            self.device,
            distiller.shift,
            self.autocast,
            self.latent_statistics,
            dataset.latent_shape(),
            self.reference_motion,
        )
        self.method = method_cls(cfg, env, self.models)
        self.method.bind(self.wrapped)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.lr_schedules: dict[str, Any] = {}
        self.scalers: dict[str, torch.amp.GradScaler] = {}
        name = "cosine" if cfg.lr_scheduler == "cosine" else "constant_with_warmup"
        for model_name, model in self.models.items():
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(
                params, fused=self.device.type == "cuda", **self.method.optimizer_settings(model_name)
            )
            self.optimizers[model_name] = optimizer
            self.lr_schedules[model_name] = get_scheduler(
                name,
                optimizer,
                num_warmup_steps=cfg.lr_warmup_steps,
                num_training_steps=self.method.update_count(model_name, self.total_steps),
            )
            self.scalers[model_name] = torch.amp.GradScaler(
                self.device.type, enabled=cfg.mixed_precision == "fp16"
            )
        self.optimizer = self.optimizers["student"]
        self.lr_schedule = self.lr_schedules["student"]
        self.scaler = self.scalers["student"]
        self.ema = None
        if cfg.ema_decay:
            from diffusers.training_utils import EMAModel

            # foreach: one fused update over all parameters, not a kernel launch (and a Python loop
            # step) per parameter tensor: a 1.3B student has about 800 of them.
            trained = [p for p in student.parameters() if p.requires_grad]
            self.ema = EMAModel(trained, decay=cfg.ema_decay, foreach=True)
        # Randomness of the GLOBAL batch, identical on every rank; each rank uses its slice. Our
        # own generators, so the random stream of training is part of the checkpoint.
        self.timestep_generator = torch.Generator("cpu").manual_seed(cfg.seed + 1)
        self.randomness = BatchRandomness(
            self.timestep_generator, cfg.seed + 2, self.ctx.data_rank, self.ctx.data_world, self.device
        )
        # Per update: this step's sums, the logged window's sums, the last grad norm, the extras' names.
        self.step_sums: dict[str, torch.Tensor] = {}
        self.window_sums: dict[str, torch.Tensor] = {}
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.window_updates: dict[str, int] = {}  # updates attempted since the last log
        self.extra_names: dict[str, list[str]] = {}
        self.step = 0
        self.consumed = 0  # global samples drawn
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss or gradient
        self.skipped_steps = 0
        self.overflowed = False  # the last step skipped an update for an fp16 overflow (and nothing worse)
        self.wandb_run_id: str | None = None
        self.faults = FaultInjector(rank=self.ctx.rank)
        # Progress inside a step: each forward of these models and of their blocks (and each backward
        # through a block) tells the stall watchdog, so a slow step that computes is not a hang.
        experts = (teacher.high, teacher.low) if teacher.low is not None else (teacher.high,)
        watched = (*experts, *self.models.values())
        watchdog.watch_forwards(*watched)
        self.faults.attach(*watched)  # DISTILL_INJECT_FAULT=slow / hang_forward act in those forwards

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_schedule": self.lr_schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "timestep_generator": self.timestep_generator.get_state(),
            "noise_draws": self.randomness.noise_draws,
            "noise_stream": BatchRandomness.STREAM,
            "rng": ckpt.rng_state(),
            # Models besides the student (their weights go to <name>.safetensors), and the method's own.
            "models": {
                name: {
                    "optimizer": self.optimizers[name].state_dict(),
                    "lr_schedule": self.lr_schedules[name].state_dict(),
                    "scaler": self.scalers[name].state_dict(),
                }
                for name in self.models
                if name != "student"
            },
            "method": self.method.state_dict(),
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
                # Which prompt and image each sample was: a resume on changed data names the one.
                "samples": sample_record(self.distiller.samples),
                "wandb_run_id": self.wandb_run_id,
                "world_size": self.ctx.world_size,
                "skipped_steps": self.skipped_steps,
                "method": self.cfg.method,
                # Where the next step starts in the method's cycle of updates (dmd: critic/generator).
                "next_updates": self.method.updates(self.step + 1),
            }
            try:
                path = ckpt.save_checkpoint(
                    ckpt.checkpoint_root(self.output_dir),
                    self.step,
                    unwrap_model(self.student).state_dict(),
                    self.checkpoint_state(),
                    meta,
                    self.cfg.keep_last,
                    extra_models={
                        name: model.state_dict() for name, model in self.models.items() if name != "student"
                    },
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
        ckpt.refuse_past_end(found.path, found.step, self.total_steps, cfg.num_steps is None)
        try:
            self._restore(found)
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:  # shapes, or missing state entries
            text = str(exc).strip()
            lora = found.meta.get("identity", {}).get("lora")
            # A LoRA run has no --student_config: its shape is the adapters' (and the critic's) flags.
            same_shape = (
                f"resume with the adapters the checkpoint was made with: {lora_flags(lora)}"
                if cfg.student_lora_rank and isinstance(lora, dict)
                else "resume with the --student_lora_rank, --student_lora_targets (and --critic_lora_rank) "
                "the checkpoint was made with"
                if cfg.student_lora_rank
                else "resume with the --student_config (and --critic_config) the checkpoint was made with"
            )
            raise DistillError(
                f"checkpoint {found.path} does not fit this run's models or optimizers",
                f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}",
                causes=["--force_resume with another student or critic shape, or another optimizer setup"],
                fixes=[
                    same_shape,
                    "or start this run in another --output_dir (a different shape cannot continue a run)",
                ],
                stage=Stage.CHECKPOINT,
            ) from None
        self.step, self.consumed = found.step, int(found.meta["consumed"])
        self.skipped_steps = int(found.meta.get("skipped_steps", 0))
        self.wandb_run_id = found.meta.get("wandb_run_id")
        if self.ctx.is_main:
            logger.info("resumed from %s (step %d)", found.path, self.step)
        return found.path

    def _restore(self, found: ckpt.Checkpoint) -> None:
        """Every model, optimizer, schedule, scaler, EMA and RNG state from `found`."""
        unwrap_model(self.student).load_state_dict(found.model)
        state = found.state
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state["ema"] is not None:
            ckpt.restore_ema(self.ema, state["ema"], self.device)
        self.timestep_generator.set_state(state["timestep_generator"])
        self.randomness.noise_draws = self._noise_draws(state, found.step)
        ckpt.restore_rng_state(state["rng"])
        for name, model in self.models.items():
            if name == "student":
                continue
            if name not in found.models or name not in state.get("models", {}):
                raise DistillError(
                    f"checkpoint {found.path} holds no {name} (made by another --method?)",
                    fixes=[
                        "resume with the --method the checkpoint was made with, or start in another --output_dir"
                    ],
                    stage=Stage.CHECKPOINT,
                )
            model.load_state_dict(found.models[name])
            self.optimizers[name].load_state_dict(state["models"][name]["optimizer"])
            self.lr_schedules[name].load_state_dict(state["models"][name]["lr_schedule"])
            self.scalers[name].load_state_dict(state["models"][name]["scaler"])
        self.method.load_state_dict(state.get("method", {}))

    def _noise_draws(self, state: dict[str, Any], step: int) -> int:
        """Where the noise stream continues. A checkpoint written before noise was seeded per sample
        holds a generator state instead: its run continues exactly in everything but the noise,
        which starts on draws no fresh run reaches."""
        if "noise_draws" in state:
            if "noise_stream" not in state and "cuda" in state["rng"] and self.ctx.is_main:
                logger.warning(
                    "this checkpoint was written on a CUDA machine before noise was drawn on the CPU: if its run "
                    "trained on the GPU, the noise from step %d on differs from what it would have drawn there "
                    "(training continues; a seed now gives the same noise on every device)",
                    step + 1,
                )
            return int(state["noise_draws"])
        if self.ctx.is_main:
            logger.warning(
                "this checkpoint predates per-sample noise seeds: training continues from it, with a new noise stream"
            )
        return (1 << 40) + step

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.mixed_precision == "no":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def latent_statistics(self) -> tuple[float, float]:
        """Mean and std of the teacher's clean latents (computed once, from the cache)."""
        if self._latent_statistics is None:
            self._latent_statistics = self.dataset.clean_latent_statistics()
        return self._latent_statistics

    def reference_motion(self) -> float | None:
        """The teacher's mean motion over the reference latents (computed once; None for pictures)."""
        if self._reference_motion is None:
            self._reference_motion = (self.dataset.reference_motion(),)
        return self._reference_motion[0]

    def micro_step(self, update: str, batch: dict[str, torch.Tensor], sync: bool, poison: bool) -> None:
        """Forward and backward of one micro-batch of `update`; adds [loss, high loss, high n, low loss,
        low n, *extras] to this step's sums (they join the logged totals only if the step is not skipped)."""
        model = self.wrapped[update]
        no_sync = model.no_sync if (self.ctx.enabled and not sync) else contextlib.nullcontext
        with no_sync():
            out = self.method.loss(update, batch, self.randomness)
            stray = out.off_device(self.device)
            if stray:
                raise DistillError(
                    f"the {self.method.name} method's {update} update returned tensors off the "
                    f"training device {self.device}: {', '.join(stray)}",
                    "Every tensor of an UpdateLoss must live on the training device (MethodEnv.device).",
                    fixes=["a bug in the method: move those tensors with .to(env.device); please report it"],
                    stage=Stage.INTERNAL,
                )
            losses = out.losses
            if poison:  # DISTILL_INJECT_FAULT=nan:STEP
                losses = losses * float("nan")
            # Under sequence parallel a rank's gradients hold only its tokens' share, and DDP's mean
            # runs over every rank of a group: scaling by the group size gives one process's gradient.
            loss = losses.mean() * self.ctx.sequence_parallel / self.cfg.gradient_accumulation_steps
            self.scalers[update].scale(loss).backward()
        names = self.extra_names.setdefault(update, sorted(out.extras))
        high = out.high_noise.float()
        detached = losses.detach()
        parts = [
            detached.sum(),
            (detached * high).sum(),
            high.sum(),
            (detached * (1 - high)).sum(),
            (1 - high).sum(),
        ]
        parts += [out.extras[name].detach().float().sum() for name in names]
        stacked = torch.stack(parts)
        if update not in self.step_sums:
            self.step_sums[update] = torch.zeros_like(stacked)
            self.window_sums[update] = torch.zeros_like(stacked)
        self.step_sums[update] += stacked

    def optimizer_step(
        self, update: str, step_loss: torch.Tensor, stop_requested: bool
    ) -> tuple[torch.Tensor, str, bool]:
        """Clip and step the model of `update`, unless loss or gradient is non-finite.

        Returns (grad norm, outcome, stop on all ranks); outcome is "stepped", "overflow" (fp16: the
        grad scaler skipped the update and lowered its scale) or "non_finite"."""
        optimizer, scaler = self.optimizers[update], self.scalers[update]
        scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        bad = ~torch.isfinite(step_loss)
        # With fp16, non-finite gradients under a finite loss are an overflow of the loss scale:
        # the scaler skips the update (it saw the same infs in unscale_) and lowers the scale.
        overflow = ~torch.isfinite(grad_norm) & ~bad
        if not scaler.is_enabled():
            bad, overflow = bad | overflow, torch.zeros_like(overflow)
        # The one per-update host sync: a bad update must be skipped on every rank alike, and a
        # preemption signal on any rank must stop all of them at the same step, so the flags are
        # reduced across ranks in one small collective before anything is updated.
        flags = torch.stack(
            [bad.float(), overflow.float(), torch.full((), float(stop_requested), device=self.device)]
        )
        if self.ctx.enabled:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        non_finite, overflowed, stop = (bool(v) for v in flags.tolist())
        if non_finite:
            optimizer.zero_grad(set_to_none=True)
            scaler.update()
            return grad_norm, "non_finite", stop
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if overflowed:  # no update was made: the LR schedule and the EMA do not advance either
            return grad_norm, "overflow", stop
        self.lr_schedules[update].step()
        if update == "student" and self.ema is not None:
            self.ema.step(params)
        return grad_norm, "stepped", stop

    def train_step(
        self, batches: Iterator[dict[str, torch.Tensor]], stop: StopRequest | None = None
    ) -> tuple[dict[str, torch.Tensor], bool, bool]:
        """One step: each update the method asks for (velocity: the student; dmd: the critic, and every
        --critic_updates steps the student first), each over `gradient_accumulation_steps` micro-batches.

        Returns (grad norm per update, whether every update stepped, stop on all ranks). `stop` is read
        just before each update, so a signal that arrives during the step stops at its end. A step
        that did not step every update sets `self.overflowed` when only fp16 overflows held it back.
        """
        cfg = self.cfg
        next_step = self.step + 1
        Progress.enter(Stage.TRAINING, next_step)
        # Arms the stall watchdog for this step; within it, every micro-batch and every forward and
        # backward of a watched model counts as progress (see __init__).
        watchdog.beat(Stage.TRAINING, next_step)
        self.faults.before_step(next_step)
        norms: dict[str, torch.Tensor] = {}
        outcomes: list[str] = []
        stop_all = False
        for update in self.method.updates(next_step):
            if update in self.step_sums:
                self.step_sums[update].zero_()
            for micro in range(cfg.gradient_accumulation_steps):
                watchdog.beat(Stage.TRAINING, next_step)
                last = micro == cfg.gradient_accumulation_steps - 1
                self.micro_step(update, next(batches), sync=last, poison=self.faults.wants_nan(next_step))
                self.consumed += cfg.batch_size * self.ctx.data_world
            self.window_updates[update] = self.window_updates.get(update, 0) + 1
            requested = stop is not None and stop.signal_name is not None
            norms[update], outcome, stop_now = self.optimizer_step(
                update, self.step_sums[update][0], requested
            )
            outcomes.append(outcome)
            stop_all = stop_all or stop_now
            if outcome != "non_finite":  # an fp16 overflow's loss is finite: it counts
                self.window_sums[update] += self.step_sums[update]
        self.grad_norms.update(norms)
        self.step = next_step
        all_stepped = all(outcome == "stepped" for outcome in outcomes)
        self.overflowed = "overflow" in outcomes and "non_finite" not in outcomes
        return norms, all_stepped, stop_all

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
        # Tracked so that a failure report can ask the worker processes whether one died.
        batches = workers.track(iter(self.make_loader()))
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
        try:
            with StopRequest(hold_on_failure=dist_utils.launched_by_torchrun()) as stop:
                while self.step < self.total_steps:
                    _, stepped, stop_now = self.train_step(batches, stop)
                    tracker.advance()
                    if stepped:
                        self.bad_steps = 0
                    elif self.overflowed:
                        self._count_overflow(result)
                    else:
                        self._count_bad_step(result)
                    if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                        self._log(tracker, result, skipped=not stepped)
                        if self.ctx.is_main:
                            monitor.plot_loss(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png")
                    self._observe(monitor, tracker)
                    if stop_now:
                        result.stopped_by_signal = stop.signal_name or "a signal on another rank"
                        if dist_utils.launched_by_torchrun():
                            stop.hold()
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
        except BaseException:
            # A failure has its own banner: a rank reporting, say, a peer that died under it is not
            # stalled, and must not be labelled so by the watchdog while it gets there.
            watchdog.pause()
            raise
        finally:
            tracker.close()
        workers.release(batches)  # on failure the workers stay until the report has looked at them
        result.steps = self.step

    def _observe(self, monitor: SampleMonitor, tracker: Tracker, final: bool = False) -> None:
        """Samples and the student-vs-teacher report when due (every rank takes part), logged on rank 0.
        `final` (the run has ended): a sample round of the last weights when the last step had none;
        what was due at the last step ran with it, and is not rendered or evaluated a second time."""
        Progress.enter(Stage.TRAINING, self.step)
        watchdog.pause()
        if final:
            last_round = monitor.settings.save_samples and not monitor.samples_due(self.step)
            files = monitor.after_step(self.step, self.student, self.ema, force=True) if last_round else []
            report = None
        else:
            files = monitor.after_step(self.step, self.student, self.ema)
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
        differ = []
        for name, model in self.models.items():
            agree, digest = dist_utils.ranks_agree(model, self.device)
            if not agree:
                differ.append(name)
        if differ:
            raise DistillError(
                f"the ranks ended with different {' and '.join(differ)} weights",
                "DDP keeps replicas identical; a difference means a rank skipped or repeated an update.",
                fixes=["report this with the command line; the rank-0 checkpoint is the one to keep"],
                stage=Stage.TRAINING,
            )
        if self.ctx.is_main:
            logger.info(
                "all %d ranks hold identical %s weights (checksum %s)",
                self.ctx.world_size,
                " and ".join(self.models),
                digest,
            )

    def _count_overflow(self, result: RunResult) -> None:
        """An fp16 overflow: skipped and counted, but not a bad step (the scaler recovers by itself)."""
        self.skipped_steps += 1
        result.bad_steps = self.skipped_steps
        if self.ctx.is_main:
            scales = ", ".join(
                f"{name} {scaler.get_scale():g}"
                for name, scaler in self.scalers.items()
                if scaler.is_enabled()
            )
            logger.info("step %d skipped: fp16 gradient overflow, loss scale lowered (%s)", self.step, scales)

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

    def _log(self, tracker: Tracker, result: RunResult, skipped: bool = False) -> None:
        names = sorted(self.window_sums)
        sums = (
            torch.cat([self.window_sums[n] for n in names]) if names else torch.zeros(0, device=self.device)
        )
        dist_utils.all_reduce_sum(sums)  # every rank reaches the same logged steps
        norms = torch.stack([self.grad_norms[n].reshape(()).float() for n in names]) if names else sums[:0]
        values = torch.cat([sums, norms]).tolist()  # the host sync of a logged step
        for window in self.window_sums.values():
            window.zero_()
        metrics = self.metrics(names, values)
        self.window_updates.clear()
        metrics["skipped_steps"] = float(self.skipped_steps)
        if skipped:  # this step did not make every update (a non-finite grad_norm is null)
            metrics["skipped"] = True
        tracker.log(self.step, metrics)
        result.history.append({"step": self.step, **metrics})
        if metrics.get("loss") is not None:  # null when every update since the last row was skipped
            if result.first_loss is None:
                result.first_loss = metrics["loss"]
            result.last_loss = metrics["loss"]

    def metrics(self, names: list[str], values: list[float]) -> dict[str, Any]:
        """Per update: loss (total and per expert range), lr, grad norm and its extras, named with the
        method's prefix (the student's update unprefixed: loss, lr, grad_norm, ...): means over the
        updates counted since the last row; None (JSON null) where there is nothing to report, never
        a made-up 0.0: no counted sample, or a non-finite gradient norm."""
        metrics: dict[str, Any] = {}
        offset = 0
        norms = values[sum(len(self.window_sums[n]) for n in names) :]
        for index, name in enumerate(names):
            width = len(self.window_sums[name])
            total, high_loss, high_n, low_loss, low_n, *extras = values[offset : offset + width]
            offset += width
            prefix = self.method.metric_prefix(name)
            count = high_n + low_n
            if not self.window_updates.get(name):
                continue  # not due in this window (dmd: no generator update since the last log)
            metrics[f"{prefix}loss"] = total / count if count else None
            metrics[f"{prefix}lr"] = self.lr_schedules[name].get_last_lr()[0]
            metrics[f"{prefix}grad_norm"] = norms[index] if math.isfinite(norms[index]) else None
            # The split by expert range; a teacher with one transformer has none (all of it is "high").
            if high_n and self.teacher.low is not None:
                metrics[f"{prefix}loss_high_noise"] = high_loss / high_n
            if low_n:
                metrics[f"{prefix}loss_low_noise"] = low_loss / low_n
            for extra, value in zip(self.extra_names[name], extras):
                if count:
                    metrics[f"{prefix}{extra}"] = value / count
        return self.method.finish_metrics(metrics)
