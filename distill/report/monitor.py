"""What the trainer shows while it runs: student samples next to teacher references, the loss
plot and the periodic student-vs-teacher report.

    python train_distillation.py ... --save_samples --sample_interval 100 --eval_interval 500

The trainer drives one `SampleMonitor`:

    monitor = SampleMonitor(SampleSettings.from_config(cfg), info, output_dir, device, rank=r, world_size=w,
                            barrier=dist.barrier)
    # add monitor.prompts to the prompt-embedding cache, then once the teacher is loaded:
    monitor.start(teacher_high, teacher_low, embeddings, negative)     # teacher references, once
    files = monitor.after_step(step, student, ema)                      # samples + grid when due
    report = monitor.evaluate(step, student, ema)                       # eval.json/eval.png when due
    monitor.plot_loss(output_dir / "metrics.jsonl", output_dir / "loss.png")  # force=True at the end

Every method is called on every rank. Each rank renders prompts[rank::world_size]; rank 0 builds
the grid and the report once `barrier()` says the other ranks' files exist (the sample folder
must be on a file system all ranks share). Under --sequence_parallel a context group renders as one
(its models are split over it): `rank`, `world_size` count groups, and one rank of each `writes`.
Only the teacher references need the teacher: they are computed once in `start`, so later rounds
run the student alone, and the VAE is loaded for each decode and freed straight after.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from distill.config.settings import FEW_STEP_METHODS
from distill.data.dataset import pad_embedding
from distill.models.pipelines import (
    decode_with_teacher_vae,
    initial_noise,
    load_scheduler,
    sample_latents,
    student_pipeline,
)
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.report.measures import (
    EvalSettings,
    build_reference,
    compare_student,
    image_vae,
    student_sampler,
)
from distill.report.prompt_sets import DEFAULT_SAMPLE_PROMPTS, PromptSet, read_prompt_set

# DEFAULT_SAMPLE_PROMPTS is re-exported: the tests import it from here.
__all__ = ["DEFAULT_SAMPLE_PROMPTS", "EvalOutput", "SampleMonitor", "SampleSettings", "sampling_weights"]
from distill.report.summary import flat_metrics, gather_and_write
from distill.sample.image_inputs import data_takes_images
from distill.sample.media import (
    first_frames,
    latent_preview,
    media_suffix,
    rank_share,
    sample_stem,
    strips,
    write_files_gif,
    write_frames,
    write_grid,
)

logger = logging.getLogger(__name__)

LOSS_PLOT_MIN_SECONDS = 10.0
POSITIVE = ("sample_interval", "sample_steps", "eval_num_buckets", "eval_samples_per_bucket", "batch_size")


def _noop() -> None:
    return None


class EmbeddingSource(Protocol):
    """Anything with `get(prompt) -> (tokens, text_dim) tensor`: the trainer's TensorCache, or a dict."""

    def get(self, prompt: str) -> torch.Tensor: ...


@dataclass
class SampleSettings:
    """Samples and evaluation during training (the TrainConfig fields of the same names)."""

    save_samples: bool = False
    """Render student samples every --sample_interval steps, next to teacher references."""
    sample_prompts: str | None = None
    """Prompt file for samples (default: the held-out prompts in data/sample_prompts.txt)."""
    sample_interval: int = 500
    """Steps between two sampling rounds."""
    sample_dir: str | None = None
    """Where samples and grids go (default <output_dir>/samples)."""
    sample_steps: int = 30
    """Sampler steps for samples, teacher references and evaluation."""
    sample_seed: int = 0
    """Prompt i of a round starts from the noise of seed sample_seed + i, for teacher and student."""
    eval_interval: int = 0
    """Write a student-vs-teacher report (eval.json, eval.png) every N steps (0 = never)."""
    eval_prompts: str | None = None
    """Prompt file for the report (default: the sample prompts)."""
    eval_num_buckets: int = 10
    """Timestep buckets over [0, 1000] for the denoiser comparison."""
    eval_samples_per_bucket: int = 1
    """Noised inputs per bucket and prompt."""
    height: int = 480
    """Sample height: the training resolution."""
    width: int = 832
    """Sample width: the training resolution."""
    num_frames: int = 1
    """Frames per sample: the training frame count (1 = PNG, otherwise MP4)."""
    guidance_scale: float = 4.0
    """Teacher guidance of the high-noise expert."""
    guidance_scale_2: float = 3.0
    """Teacher guidance of the low-noise expert."""
    max_sequence_length: int = 512
    """Rows the prompt embeddings are zero-padded to, as in training."""
    batch_size: int = 1
    """Noised inputs per forward in the report: the training batch size, known to fit in memory."""
    method: str = "velocity"
    """The training method: dmd students sample with their own K-step scheduler."""
    student_steps: int = 4
    """dmd: the student's sampler steps K (the teacher keeps sample_steps)."""
    student_shift: float = 5.0
    """dmd: shift of the student's K-step flow-match scheduler."""
    student_shift_terminal: float | None = None
    """dmd: the sigma the student's last step lands at (None: the shifted grid as it is)."""
    data_path: str | None = None
    """The training prompts: for a teacher with two modes (TI2V-5B), whether they pair images says
    the run's mode, and so whether the samples start from images."""

    @classmethod
    def from_config(cls, cfg: Any) -> SampleSettings:
        """Copy the fields of the same name from a TrainConfig (those it lacks keep their defaults)."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)}
        return cls(**values)

    @property
    def enabled(self) -> bool:
        return self.save_samples or self.eval_interval > 0

    def validate(self) -> None:
        """Refuse values the monitor cannot work with, naming the flag to change."""
        for name in POSITIVE:  # settings that must be above 0
            if getattr(self, name) <= 0:
                raise DistillError(
                    f"--{name} must be a positive integer, got {getattr(self, name)}",
                    fixes=[f"set --{name} to 1 or more"],
                    stage=Stage.CONFIG,
                )
        if self.eval_interval < 0:
            raise DistillError(
                f"--eval_interval must be 0 (off) or positive, got {self.eval_interval}",
                fixes=["set --eval_interval 0 to turn the report off"],
                stage=Stage.CONFIG,
            )

    @property
    def few_step(self) -> bool:
        return self.method in FEW_STEP_METHODS

    def student_scheduler(self) -> dict[str, Any] | None:
        """A few-step student's scheduler config (what it is exported with); None = the teacher's."""
        if not self.few_step:
            return None
        from distill.models.few_step import few_step_scheduler

        scheduler = few_step_scheduler(self.student_shift, self.student_shift_terminal)
        return {"_class_name": type(scheduler).__name__, **dict(scheduler.config)}

    def eval_settings(self) -> EvalSettings:
        return EvalSettings(
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            steps=self.sample_steps,
            seed=self.sample_seed,
            num_buckets=self.eval_num_buckets,
            samples_per_bucket=self.eval_samples_per_bucket,
            guidance_scale=self.guidance_scale,
            guidance_scale_2=self.guidance_scale_2,
            probe_batch=self.batch_size,
            student_steps=self.student_steps if self.few_step else None,
            student_scheduler=self.student_scheduler(),
        )


class EvalOutput(NamedTuple):
    """What `SampleMonitor.evaluate` wrote (rank 0: eval.json, eval.png) and its headline scalars."""

    files: list[Path]
    metrics: dict[str, float]


@contextlib.contextmanager
def sampling_weights(student: torch.nn.Module, ema: Any = None) -> Iterator[torch.nn.Module]:
    """The plain student module in eval mode, holding the EMA weights if `ema` is given; restored after.

    A DDP wrapper is bypassed: sampling runs a different number of forwards per rank and must
    not enter DDP's collectives. `ema` is a diffusers EMAModel over student.parameters().
    """
    model = getattr(student, "module", student)
    was_training = model.training
    params = list(model.parameters())
    if ema is not None:
        ema.store(params)
        ema.copy_to(params)
    model.eval()
    try:
        yield model
    finally:
        if ema is not None:
            ema.restore(params)
        model.train(was_training)


class SampleMonitor:
    """Samples, grids, loss plot and evaluation for one training run (see the module docstring)."""

    def __init__(
        self,
        settings: SampleSettings,
        info: TeacherInfo,
        output_dir: str | Path,
        device: torch.device,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] = _noop,
        writes: bool = True,
    ) -> None:
        settings.validate()
        self.settings, self.info = settings, info
        self.output_dir = Path(output_dir)
        self.sample_dir = Path(settings.sample_dir) if settings.sample_dir else self.output_dir / "samples"
        self.eval_dir = self.output_dir / "eval"
        self.device = device
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        self.writes = writes
        self.is_main = rank == 0 and writes
        # Only the files a run uses are read (an image-to-video run has no default to fall back on).
        self.image_mode = data_takes_images(info.kind, settings.data_path)
        size = (info, settings.height, settings.width, self.image_mode, settings.data_path)
        own_evals = settings.eval_prompts is not None
        self.samples = PromptSet([])
        if settings.save_samples or (settings.eval_interval > 0 and not own_evals):
            self.samples = read_prompt_set(settings.sample_prompts, "sample_prompts", *size)
        self.evals = self.samples
        if own_evals:
            self.evals = read_prompt_set(settings.eval_prompts, "eval_prompts", *size)
        self.latent_shape = info.latent_shape(settings.height, settings.width, settings.num_frames)
        self._scheduler = None
        self.teacher_files: list[Path] = []
        self._teacher_previews: list[Any] = []
        # The redraw window starts now, not at the first logged step: a run that ends within it draws
        # loss.png once, at its end (a redraw and matplotlib's import cost ~1 s, most of a short run).
        self._last_loss_plot = time.monotonic()

    # -- what the trainer asks -----------------------------------------------------------------
    @property
    def prompts(self) -> list[str]:
        """Every prompt the monitor needs an embedding for: add them to the embedding cache."""
        if not self.settings.enabled:
            return []
        wanted = self.samples.prompts if self.settings.save_samples else []
        if self.settings.eval_interval:
            wanted = wanted + self.evals.prompts
        return list(dict.fromkeys(wanted))

    def samples_due(self, step: int) -> bool:
        return self.settings.save_samples and step % self.settings.sample_interval == 0

    def eval_due(self, step: int) -> bool:
        return self.settings.eval_interval > 0 and step % self.settings.eval_interval == 0

    # -- start ---------------------------------------------------------------------------------
    def start(
        self,
        teacher_high: torch.nn.Module,
        teacher_low: torch.nn.Module | None,
        embeddings: EmbeddingSource | Mapping[str, torch.Tensor],
        negative: torch.Tensor,
    ) -> list[Path]:
        """Render the teacher references once (same prompts, same seeds as every student round).

        `embeddings.get(prompt)` gives each prompt's embedding, trimmed or padded; `negative` is
        the negative prompt's. Returns the teacher files written (rank 0: all of them).
        """
        if not self.settings.enabled:
            return []
        # (tokens, D) from the cache or the trainer's padded (1, L, D): the same rows either way
        negative = pad_embedding(negative.reshape(-1, negative.shape[-1]), self.settings.max_sequence_length)
        sets = [self.samples] if self.settings.save_samples else []
        if self.settings.eval_interval and self.evals not in sets:
            sets.append(self.evals)  # its own prompts, or the sample prompts when not saving samples
        for prompt_set in sets:
            self._fill_conds(prompt_set, embeddings)
            with_probes = self.settings.eval_interval > 0 and prompt_set is self.evals
            prompt_set.reference = build_reference(
                teacher_high,
                teacher_low,
                self.info,
                prompt_set.conds,
                negative,
                len(prompt_set.prompts),
                self.settings.eval_settings(),
                self.device,
                rank=self.rank,
                world_size=self.world_size,
                with_probes=with_probes,
                images=prompt_set.images,
            )
        if not self.settings.save_samples:
            return []
        reference = self.samples.reference
        mine = self._write_round(
            None, [z for z, (_, keep) in zip(reference.latents, reference.items) if keep]
        )
        self.barrier()
        self.teacher_files = self._round_files(None)
        if not self.is_main:
            return mine
        self._teacher_previews = self._collect_previews(None)
        return self.teacher_files

    def _fill_conds(self, prompt_set: PromptSet, embeddings: Any) -> None:
        mine = {index for index, _ in rank_share(len(prompt_set.prompts), self.rank, self.world_size)}
        length = self.settings.max_sequence_length
        prompt_set.conds = {i: pad_embedding(embeddings.get(prompt_set.prompts[i]), length) for i in mine}

    # -- samples -------------------------------------------------------------------------------
    def after_step(
        self, step: int, student: torch.nn.Module, ema: Any = None, *, force: bool = False
    ) -> list[Path]:
        """Sample the student (EMA weights if `ema`) when `step` is a multiple of sample_interval.

        Writes step_<step>_prompt_<i>.png/.mp4 and, on rank 0, grid_step_<step>.png; returns the
        files written (rank 0: every rank's samples of this step and the grid), [] when not due.
        """
        if not self.settings.save_samples or not (force or self.samples_due(step)):
            return []
        with sampling_weights(student, ema) as model:
            latents = self._sample_student(model)
        mine = self._write_round(step, latents)
        self.barrier()
        if not self.is_main:
            return mine
        files = self._round_files(step)
        settings = self.settings
        student_steps = settings.student_steps if settings.few_step else settings.sample_steps
        # Every row says its model, steps and guidance: the two can run different step counts.
        guidance = f"{settings.guidance_scale:g}"
        if self.info.boundary_ratio is not None:  # two experts, each its own guidance
            guidance += f" / {settings.guidance_scale_2:g}"
        teacher = f"teacher\n{settings.sample_steps} steps\nguidance {guidance}"
        student_label = f"student\n{student_steps} steps\nguidance 1"
        # A clip's row shows a strip of its frames, so the motion is visible in a still picture.
        rows = [
            (teacher, strips(self.teacher_files)),
            (student_label, strips(files)),
            ("teacher latent", self._teacher_previews),
            ("student latent", self._collect_previews(step)),
        ]
        # Clips also get one GIF to play: teacher above student, same noise.
        gif = self.sample_dir / f"grid_step_{step:08d}.gif"
        teacher_gif, student_gif = f"teacher {settings.sample_steps} steps", f"student {student_steps} steps"
        pairs = [(teacher_gif, self.teacher_files), (student_gif, files)]
        extra = [write_files_gif(pairs, gif)] if settings.num_frames > 1 else []
        grid = write_grid(
            rows,
            self.sample_dir / f"grid_step_{step:08d}.png",
            prompts=self.samples.prompts,
            title=f"step {step}: teacher ({settings.sample_steps} steps, its guidance) vs student "
            f"({student_steps} steps, guidance 1), same noise",
        )
        return [*files, *extra, grid]

    def _sample_student(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The student's final latents from the teacher references' noise: with the teacher's scheduler
        at sample_steps, or a dmd student's own K-step sampler (distill.models.few_step.sample_few_step)."""
        settings = self.settings
        if self.samples.images is not None:  # image to video: each prompt from its own image
            steps = settings.student_steps if settings.few_step else settings.sample_steps
            with image_vae(self.info, self.samples.images, self.device) as vae:
                run = student_sampler(
                    model, self.info, self.samples.conds, settings.eval_settings(), self.samples.images, vae
                )
                return [run(index, steps) for index, keep in self.samples.reference.items if keep]
        if settings.few_step:
            run = student_sampler(model, self.info, self.samples.conds, settings.eval_settings())
            steps = settings.student_steps
        else:
            if self._scheduler is None:
                self._scheduler = load_scheduler(self.info.path)
            pipe = student_pipeline(model, self._scheduler, self.info.kind, image=False)

            def run(index: int, steps: int) -> torch.Tensor:
                noise = initial_noise(self.latent_shape, settings.sample_seed + index)
                return sample_latents(pipe, noise, self.samples.conds[index], None, steps, 1.0)

            steps = settings.sample_steps
        latents = []
        for index, keep in self.samples.reference.items:
            latent = run(index, steps)  # every item, as before: ranks sample alike
            if keep:
                latents.append(latent)
        return latents

    def _write_round(self, step: int | None, latents: Sequence[torch.Tensor]) -> list[Path]:
        """Decode this rank's latents (VAE loaded for this only) and write them, plus latent
        previews for rank 0's grid (hidden files, removed once the grid is drawn); none if not `writes`."""
        if not self.writes:
            return []
        indices = [index for index, keep in self.samples.reference.items if keep]
        for index, latent in zip(indices, latents):
            write_frames(latent_preview(latent)[None] / 255.0, self._preview_path(step, index))
        frames = decode_with_teacher_vae(latents, self.info.path, self.device)
        return [write_frames(f, self.sample_dir / sample_stem(step, i)) for i, f in zip(indices, frames)]

    def _preview_path(self, step: int | None, index: int) -> Path:
        return self.sample_dir / ".latent_previews" / f"{sample_stem(step, index)}.png"

    def _collect_previews(self, step: int | None) -> list[Any]:
        paths = [self._preview_path(step, i) for i in range(len(self.samples.prompts))]
        previews = first_frames(paths)
        for path in paths:
            path.unlink()
        with contextlib.suppress(OSError):  # another round may be writing into it
            paths[0].parent.rmdir()
        return previews

    def _round_files(self, step: int | None) -> list[Path]:
        suffix = media_suffix(self.settings.num_frames)
        return [self.sample_dir / f"{sample_stem(step, i)}{suffix}" for i in range(len(self.samples.prompts))]

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(
        self, step: int, student: torch.nn.Module, ema: Any = None, *, force: bool = False
    ) -> EvalOutput | None:
        """The student-vs-teacher report when `step` is a multiple of eval_interval (None otherwise).

        Writes <output_dir>/eval/step_<step>/eval.json and eval.png on rank 0; rank 0 gets the files
        and flat scalars (eval/denoiser_mse, eval/frame_psnr_db, ...) to log, other ranks empty ones.
        """
        if not (force or self.eval_due(step)) or self.evals.reference is None:
            return None
        with sampling_weights(student, ema) as model:
            records = compare_student(
                model,
                self.evals.reference,
                self.info,
                self.evals.conds,
                self.evals.prompts,
                self.settings.eval_settings(),
                self.device,
                images=self.evals.images,
            )
        out_dir = self.eval_dir / f"step_{step:08d}"
        result = gather_and_write(
            records,
            self.settings.eval_settings(),
            self.info.boundary_ratio,
            out_dir,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.barrier,
            extra={"step": step, "teacher": str(self.info.path), "ema": ema is not None},
            hand_in=self.writes,
        )
        if result is None:
            return EvalOutput([], {})
        return EvalOutput([out_dir / "eval.json", out_dir / "eval.png"], flat_metrics(result))

    # -- loss plot -----------------------------------------------------------------------------
    def plot_loss(
        self, metrics_jsonl: str | Path, out_png: str | Path, *, force: bool = False
    ) -> Path | None:
        """Redraw loss.png from metrics.jsonl; call it at every logged step and with force=True at the end.

        Rank 0 only. A redraw costs ~0.15 s, so without `force` it is skipped when the last one is
        less than LOSS_PLOT_MIN_SECONDS old, or the monitor was made less than that ago (tiny runs log
        many times a second, and a short run then draws only at its end). Returns the file,
        or None when nothing was drawn.
        """
        now = time.monotonic()
        if not self.is_main or (not force and now - self._last_loss_plot < LOSS_PLOT_MIN_SECONDS):
            return None
        from distill.report.plots import plot_loss

        path = plot_loss(metrics_jsonl, out_png, experts=1 if self.info.boundary_ratio is None else 2)
        self._last_loss_plot = now if path is not None else self._last_loss_plot
        return path
