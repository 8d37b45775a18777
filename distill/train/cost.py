"""What a run costs in compute, before it starts: each model's FLOPs from its config, the forwards a run
makes (the clean-latent cache before step 1, every update, sample rounds and evaluations), and the
whole run's GPU-hours on an H100 at a stated model-FLOP utilisation (--mfu).

FLOPs come from each model's config (distill.train.flops: the matrix products of a forward and of
its backward, as torch's FlopCounterMode counts them). A LoRA student or critic runs the whole expert
and its adapters; its backward computes input gradients through the frozen base (about one forward)
plus the adapters' weight gradients.

What a step runs (see the methods): velocity, per sample: one teacher forward (doubled where the
owning expert's guidance is above 1) and one student forward + backward. dmd generator update: the
student's rollout without gradient to a uniformly chosen one of its steps (k forwards), its forward +
backward (batch doubled by the regression term), one guided teacher forward, one critic forward; dmd
critic update (every step): the rollout again plus one student forward without gradient, then the
critic's forward + backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.config.causal_rules import latent_frames
from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo
from distill.train.flops import model_flops

H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of one H100 SXM (no sparsity)
# The watchdog must survive this many times the longest beat-free stretch the plan gives: a step
# that runs that much slower than planned (throttled GPU, contended host, streamed teacher) is slow,
# not hung.
STALL_MARGIN = 20
# Pinned host-to-device copy rate measured on an H200; a teacher streamed from CPU RAM waits
# at most this long per forward on top of its compute.
HOST_TO_DEVICE_BYTES_PER_S = 51.7e9
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# What the run does
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunCounts:
    """The prompt counts a run's files give (the settings give everything else)."""

    training_prompts: int
    cached_prompts: int  # prompts the teacher samples a clean latent for before step 1
    sample_prompts: int  # 0 without --save_samples
    eval_prompts: int  # 0 without --eval_interval

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> RunCounts:
        """Read the prompt files as the trainer does (--max_prompts, --reference_prompts, the sample
        and evaluation prompt files)."""
        from distill.data.prompts import read_prompts, reference_prompts
        from distill.report.prompt_sets import DEFAULT_SAMPLE_PROMPTS
        from distill.train.methods import method_class

        prompts = read_prompts(cfg.data_path)[: cfg.max_prompts]
        cached = prompts
        if not method_class(cfg.method).needs_clean_latents(cfg):
            cached = reference_prompts(prompts, cfg.reference_prompts)

        def count(path: str | None) -> int:
            file = Path(path) if path else DEFAULT_SAMPLE_PROMPTS
            if not file.is_file() and not file.is_absolute():
                file = REPO / file  # as the monitor finds the shipped prompt files
            return len(read_prompts(file))

        samples = count(cfg.sample_prompts) if cfg.save_samples else 0
        evals = count(cfg.eval_prompts or cfg.sample_prompts) if cfg.eval_interval else 0
        return cls(len(prompts), len(cached), samples, evals)


@dataclass
class Forwards:
    """Forwards of one sample through each model, without and with gradient (a doubled batch counts
    twice: its FLOPs are twice a sample's)."""

    no_grad: dict[str, float] = field(default_factory=dict)
    grad: dict[str, float] = field(default_factory=dict)

    def add(self, model: str, count: float, with_grad: bool = False) -> None:
        where = self.grad if with_grad else self.no_grad
        where[model] = where.get(model, 0.0) + count

    def scaled(self, factor: float) -> Forwards:
        return Forwards(
            {k: v * factor for k, v in self.no_grad.items()}, {k: v * factor for k, v in self.grad.items()}
        )

    def plus(self, other: Forwards) -> Forwards:
        total = Forwards(dict(self.no_grad), dict(self.grad))
        for model, count in other.no_grad.items():
            total.add(model, count)
        for model, count in other.grad.items():
            total.add(model, count, with_grad=True)
        return total

    def describe(self) -> str:
        parts = [f"{model} {count:g}" for model, count in self.no_grad.items() if count]
        parts += [f"{model} {count:g} forward+backward" for model, count in self.grad.items() if count]
        return ", ".join(parts) if parts else "none"


def high_noise_share(cfg: TrainConfig, shift: float, boundary_ratio: float | None) -> float:
    """The share of training timesteps (and dmd score timesteps) the high-noise expert owns: uniform
    numbers shifted like the teacher's sampler (flow_matching.sample_sigmas), t >= boundary."""
    if cfg.trains_critic and cfg.expert_phase != "both":
        return 1.0 if cfg.expert_phase == "high" else 0.0
    if boundary_ratio is None:  # one transformer takes every timestep
        return 1.0
    # sigma = shift u / (1 + (shift - 1) u) is monotonic: invert it at the boundary.
    at_boundary = boundary_ratio / (shift - (shift - 1.0) * boundary_ratio)
    return 1.0 - at_boundary


def teacher_guided(cfg: TrainConfig, experts: int) -> bool:
    """Whether any teacher forward runs the unconditional pass: either expert's guidance above 1; with
    one transformer only --guidance_scale counts (GuidedTeacher never uses --guidance_scale_2 then)."""
    scales = (cfg.guidance_scale, cfg.guidance_scale_2)[:experts]
    return max(scales) > 1.0


def teacher_passes(cfg: TrainConfig, high_share: float) -> float:
    """Teacher forwards per sample of GuidedTeacher.velocity: two (conditional and unconditional, one
    batch) where the owning expert's guidance is above 1, else one."""
    high = 2.0 if cfg.guidance_scale > 1.0 else 1.0
    low = 2.0 if cfg.guidance_scale_2 > 1.0 else 1.0
    return high_share * high + (1.0 - high_share) * low


def rollout_depth(cfg: TrainConfig, boundary_ratio: float | None) -> float:
    """dmd with simulate inputs: the mean of k, the step a rollout stops at (k forwards without
    gradient), uniform over the student's steps its --expert_phase trains (all of them with one
    transformer: no boundary splits them)."""
    if cfg.dmd_inputs != "simulate":
        return 0.0
    from distill.models.few_step import few_step_scheduler, student_grid
    from distill.train.methods.dmd import phase_steps

    timesteps, _ = student_grid(
        few_step_scheduler(cfg.student_shift, cfg.student_shift_terminal), cfg.student_steps
    )
    choices = phase_steps(timesteps, boundary_ratio, cfg.expert_phase)  # as the method draws them
    return sum(choices) / len(choices)


def rollout_length(cfg: TrainConfig) -> float:
    """self_forcing with --rollout_frames: the mean rollout in clips (it ends with a window of the
    clip's length drawn uniformly among the chunk-aligned ones), else 1."""
    if cfg.method != "self_forcing" or not cfg.longer_rollout:
        return 1.0
    clip, rollout = latent_frames(cfg.num_frames), latent_frames(cfg.rollout_frames)
    return (clip + rollout) / (2.0 * clip)


def update_forwards(cfg: TrainConfig, info: TeacherInfo) -> dict[str, Forwards]:
    """Per sample of a micro-batch: the forwards of each update the method runs."""
    shift = cfg.flow_shift if cfg.flow_shift is not None else info.flow_shift
    teacher = teacher_passes(cfg, high_noise_share(cfg, shift, info.boundary_ratio))
    if not cfg.trains_critic:
        velocity = Forwards()
        if cfg.method != "ode_init":  # ode_init regresses the cached pairs: no teacher in the step
            velocity.add("teacher", teacher)
        velocity.add("student", 1.0, with_grad=True)
        return {"student": velocity}
    depth = rollout_depth(cfg, info.boundary_ratio)
    # self_forcing: each finished chunk also passes once at t=0 into the KV cache (about one more clip),
    # through every expert of a LoRA student (each keeps its own cache).
    context = 0.0
    if cfg.method == "self_forcing":
        context = float(info.kind.experts) if cfg.student_lora_rank else 1.0
    longer = rollout_length(cfg)
    generator = Forwards()
    # A longer rollout: every step of its chunks, and the exits of those before the judged window.
    generator.add("student", (depth + context) * longer + (longer - 1.0))
    generator.add("student", 2.0 if cfg.regression_weight > 0 else 1.0, with_grad=True)
    generator.add("teacher", teacher)
    generator.add("critic", 1.0)
    critic = Forwards()
    critic.add("student", (depth + 1.0 + context) * longer)  # the rollout, then x0_hat
    critic.add("critic", 1.0, with_grad=True)
    return {"student": generator, "critic": critic}


def total_steps(cfg: TrainConfig, counts: RunCounts, world_size: int) -> int:
    """Optimizer steps of the run (as TrainingLoop computes them)."""
    if cfg.num_steps is not None:
        return cfg.num_steps
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps * world_size
    return (cfg.num_epochs or 1) * math.ceil(counts.training_prompts / per_step)


def update_counts(cfg: TrainConfig, steps: int) -> dict[str, int]:
    """How many times each update runs in `steps` steps (dmd: the critic every step, the student
    every --critic_updates-th from the first)."""
    if not cfg.trains_critic:
        return {"student": steps}
    return {"student": math.ceil(steps / cfg.critic_updates), "critic": steps}


# ---------------------------------------------------------------------------------------------
# The run's cost
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunCost:
    """FLOPs of the run's parts, summed over every GPU, and what they come from."""

    forward_flops: dict[str, float]  # one forward of one sample, per model
    step_flops: dict[str, float]  # one forward + backward (+ recompute) of one sample, per trained model
    cache_forwards: int  # teacher forwards before step 1 (batch 1 each)
    cache_split: tuple[int, int]  # of which the high- and the low-noise expert (one transformer: all high)
    per_sample: dict[str, Forwards]  # per update
    updates: dict[str, int]
    samples_per_update: int  # global samples of one update (batch x accumulation x world)
    steps: int
    flops: dict[str, float]  # cache, training, samples and evaluations
    mfu: float
    world_size: int
    beat_free_seconds: float
    beat_free_what: str
    experts: int = 2  # the teacher's transformers: 1 for TI2V-5B

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def gpu_hours(self, part: str | None = None) -> float:
        flops = self.total_flops if part is None else self.flops[part]
        return flops / (H100_BF16_FLOPS * self.mfu) / 3600.0


def _teacher_steps_split(info: TeacherInfo, steps: int) -> tuple[int, int]:
    """(high, low) of the teacher sampler's `steps` timesteps, split at the boundary as WanPipeline does
    (one transformer: (steps, 0), it runs them all)."""
    from distill.models.flow_matching import high_noise_mask

    if info.boundary_ratio is None:
        return steps, 0
    scheduler_file = info.path / "scheduler" / "scheduler_config.json"
    if scheduler_file.is_file():
        from distill.models.pipelines import load_scheduler

        scheduler = load_scheduler(info.path)
    else:  # a plan from a config dict alone: the A14B scheduler
        from diffusers import UniPCMultistepScheduler

        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=info.flow_shift
        )
    scheduler.set_timesteps(steps)
    high = int(high_noise_mask(scheduler.timesteps, info.boundary_ratio).sum())
    return high, steps - high


def run_cost(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    counts: RunCounts,
    world_size: int = 1,
    placement: str = "gpu",
    teacher_bytes: float = 0.0,
) -> RunCost:
    """The FLOPs of the whole run and its longest stretch between two watchdog beats."""
    shape = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    text = cfg.max_sequence_length
    expert = info.expert_config
    mfu = cfg.mfu
    # TI2V-5B: every model (teacher, student, critic) is given a timestep per token.
    per_token = info.kind.per_token_timesteps

    def trained_flops(config: dict[str, Any], rank: int) -> Any:
        if cfg.student_lora_rank and rank:
            return model_flops(expert, shape, text, "lora", rank, cfg.lora_targets, per_token)
        return model_flops(config, shape, text, "all", token_timesteps=per_token)

    models = {"teacher": model_flops(expert, shape, text, token_timesteps=per_token)}
    if cfg.student_lora_rank:
        models["student"] = trained_flops(expert, cfg.student_lora_rank)
        if critic_config is not None:
            models["critic"] = trained_flops(expert, cfg.critic_adapter_rank)
    else:
        models["student"] = trained_flops(student_config, 0)
        if critic_config is not None:
            models["critic"] = trained_flops(critic_config, 0)
    forward = {name: flops.forward for name, flops in models.items()}
    step = {
        name: flops.trained_step(cfg.gradient_checkpointing)
        for name, flops in models.items()
        if name != "teacher"
    }

    # Before step 1: WanPipeline samples each cached prompt; it runs the unconditional pass (a second
    # batch-1 forward) at every step when the high-noise expert's guidance is above 1, for both experts.
    guided_sampler = 2 if cfg.guidance_scale > 1.0 else 1
    per_rank = math.ceil(counts.cached_prompts / world_size)  # ranks keep in step: the busiest one counts
    high, low = _teacher_steps_split(info, cfg.teacher_sample_steps)
    cache_forwards = counts.cached_prompts * cfg.teacher_sample_steps * guided_sampler
    cache = world_size * per_rank * cfg.teacher_sample_steps * guided_sampler * forward["teacher"]

    # A context group (--sequence_parallel) trains one slice of the global batch on N ranks.
    groups = max(world_size // cfg.sequence_parallel, 1)
    steps = total_steps(cfg, counts, groups)
    per_sample = update_forwards(cfg, info)
    updates = update_counts(cfg, steps)
    samples = cfg.batch_size * cfg.gradient_accumulation_steps * groups

    def flops_of(forwards: Forwards) -> float:
        return sum(forward[m] * n for m, n in forwards.no_grad.items()) + sum(
            step[m] * n for m, n in forwards.grad.items()
        )

    training = sum(flops_of(per_sample[u]) * updates[u] * samples for u in per_sample)
    monitor = _monitor_flops(cfg, counts, world_size, steps, forward)
    flops = {"cache": cache, "training": training, "samples and evaluations": monitor}

    experts = info.kind.experts
    seconds, what = longest_beat_free_seconds(cfg, forward, step, placement, teacher_bytes, experts)
    return RunCost(
        forward_flops=forward,
        step_flops=step,
        cache_forwards=cache_forwards,
        cache_split=(
            counts.cached_prompts * high * guided_sampler,
            counts.cached_prompts * low * guided_sampler,
        ),
        per_sample=per_sample,
        updates=updates,
        samples_per_update=samples,
        steps=steps,
        flops=flops,
        mfu=mfu,
        world_size=world_size,
        beat_free_seconds=seconds,
        beat_free_what=what,
        experts=experts,
    )


def longest_beat_free_seconds(
    cfg: TrainConfig,
    forward: dict[str, float],
    step: dict[str, float],
    placement: str = "gpu",
    teacher_bytes: float = 0.0,
    experts: int = 2,
) -> tuple[float, str]:
    """The longest stretch of a training step without a watchdog beat, in seconds at --mfu, and what
    it is. The watchdog beats at least once per model forward and per backward, so the longest stretch
    is one teacher forward at its largest batch (guidance doubles it; streamed from host RAM on the
    cpu placement, one expert's weights cross once more) or one forward + backward of a trained model
    (the student's batch doubled by the dmd regression term). `forward` and `step` are FLOPs per
    sample (RunCost.forward_flops, RunCost.step_flops); `teacher_bytes` the weights of all `experts`
    transformers (a forward streams one of them)."""
    throughput = H100_BF16_FLOPS * cfg.mfu
    guided = 2 if teacher_guided(cfg, experts) else 1
    streamed = teacher_bytes / experts / HOST_TO_DEVICE_BYTES_PER_S if placement == "cpu" else 0.0
    stretches = {"one teacher forward": cfg.batch_size * guided * forward["teacher"] / throughput + streamed}
    regression = 2 if cfg.method == "dmd" and cfg.regression_weight > 0 else 1
    for name, flops in step.items():
        batch = cfg.batch_size * (regression if name == "student" else 1)
        stretches[f"one {name} forward+backward"] = batch * flops / throughput
    longest = max(stretches, key=stretches.get)
    return stretches[longest], longest


def _monitor_flops(
    cfg: TrainConfig, counts: RunCounts, world_size: int, steps: int, forward: dict[str, float]
) -> float:
    """Sample rounds and evaluations (distill.report.monitor): the teacher references once at the start
    (a 2-step warm-up, then sample_steps, and the student's step count when it has fewer), then the
    student's rounds; every rank samples as many prompts as the busiest (they keep in step). A context
    group (--sequence_parallel) samples as one: its ranks share each forward's FLOPs."""
    groups = max(world_size // cfg.sequence_parallel, 1)
    few_step = cfg.few_step
    student_steps = cfg.student_steps if few_step else cfg.sample_steps
    teacher_runs = 2 + cfg.sample_steps + (student_steps if student_steps < cfg.sample_steps else 0)
    guided = 2 if cfg.guidance_scale > 1.0 else 1
    total = 0.0
    if counts.sample_prompts:
        items = groups * math.ceil(counts.sample_prompts / groups)
        total += items * teacher_runs * guided * forward["teacher"]
        rounds = math.ceil(steps / cfg.sample_interval)
        total += rounds * items * student_steps * forward["student"]
    if counts.eval_prompts:
        items = groups * math.ceil(counts.eval_prompts / groups)
        probes = cfg.eval_num_buckets * cfg.eval_samples_per_bucket
        if cfg.eval_prompts or not counts.sample_prompts:  # its own set: its own teacher references
            total += items * teacher_runs * guided * forward["teacher"]
        total += items * probes * guided * forward["teacher"]
        evaluations = steps // cfg.eval_interval
        total += evaluations * items * (min(2, student_steps) + student_steps + probes) * forward["student"]
    return total


def flops_text(flops: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if flops >= size:
            return f"{flops / size:.3f} {unit}"
    return f"{flops / 1e6:.3f} MFLOP"


def hours_text(hours: float) -> str:
    return f"{hours:.1f}" if hours >= 0.1 else f"{hours:.2g}"


def cost_lines(cost: RunCost, cfg: TrainConfig, counts: RunCounts) -> list[str]:
    """The plan's cost section."""
    hours = cost.gpu_hours()
    lines = [
        f"cost (H100 bf16 {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s at MFU {cost.mfu:g}, --mfu; FLOPs of the "
        "matrix products from the models' configs):",
        "  one forward of one sample: "
        + ", ".join(f"{name} {flops_text(flops)}" for name, flops in cost.forward_flops.items()),
        f"  before step 1: {cost.cache_forwards} teacher forwards ("
        + (
            f"high {cost.cache_split[0]}, low {cost.cache_split[1]}"
            if cost.experts == 2
            else "all on the one transformer"
        )
        + f") for {counts.cached_prompts} prompt(s) x {cfg.teacher_sample_steps} steps"
        + (" x 2 (guidance)" if cfg.guidance_scale > 1.0 else "")
        + f": {hours_text(cost.gpu_hours('cache'))} GPU-hours",
    ]
    for update, forwards in cost.per_sample.items():
        lines.append(
            f"  per sample, {update} update: {forwards.describe()} "
            f"({cost.updates[update]} updates x {cost.samples_per_update} samples)"
        )
    lines += [
        f"  training: {cost.steps} steps: {hours_text(cost.gpu_hours('training'))} GPU-hours; samples and "
        f"evaluations: {hours_text(cost.gpu_hours('samples and evaluations'))}",
        f"  whole run: {hours_text(hours)} GPU-hours ({hours_text(hours / cost.world_size)} h on {cost.world_size} GPU"
        + ("s" if cost.world_size > 1 else "")
        + ")",
    ]
    verdict = stall_verdict(cost.beat_free_seconds, cost.beat_free_what, cfg.stall_timeout)
    lines.append(f"  longest stretch between watchdog beats: {verdict}")
    return lines


def stall_verdict(stretch: float, what: str, stall_timeout: float) -> str:
    """The longest stretch without a watchdog beat (seconds; `what` runs in it) and what --stall_timeout
    (minutes) is to it, in words. A ratio over a stretch that rounds to 0.0 s is a number nobody can use (a tiny model's
    step: "48118750 x that"): under a second it says so instead."""
    stall = stall_timeout * 60
    short = stretch < 1.0
    what = f"well under a second ({what})" if short else f"{stretch:.1f} s ({what})"
    if not stall:
        return f"{what}; --stall_timeout off"
    if stall < STALL_MARGIN * stretch:
        return f"{what}; --stall_timeout {stall_timeout:g} min is less than {STALL_MARGIN} x that: raise it"
    if short:
        return f"{what}; --stall_timeout {stall_timeout:g} min is far above it"
    return f"{what}; --stall_timeout {stall_timeout:g} min = {stall / stretch:.0f} x that"
