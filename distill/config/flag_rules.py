"""Flags that would be accepted and then do nothing, or something other than they say: refused with why.

Two kinds, checked the same way by the trainer and by the command-line tools:

- a DEPENDENT flag given without the setting that makes it act (`--student_init_expert high` without
  `--student_init teacher`, `--critic_updates` without `--method dmd`, `generate --guidance_2` for a
  one-model student): refused naming what enables it. Only flags the user gave count (on the command
  line or in a --config file), so a default never trips a rule.
- guidance scales: classifier-free guidance is uncond + scale x (cond - uncond). WanPipeline (which
  samples the teacher's clean latents, `generate` and `evaluate`) guides only when the high-noise
  scale is above 1 and treats anything up to 1 as no guidance, while the trainer's target would
  apply the scale as written: a scale below 1 (a negative one inverts the prompt) or a low-noise
  scale above 1 under a high-noise scale of 1 would not be applied as given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distill.ops.errors import DistillError, Stage


@dataclass(frozen=True)
class Dependent:
    """Settings `names` act only while `active(settings)` holds; `needs` says what turns that on,
    `enable` how to write it (the fix offered beside dropping the flag). `off` maps a setting to the
    value that switches what it does off (given with the rule inactive, it asks for nothing)."""

    names: tuple[str, ...]
    active: Callable[[Any], bool]
    needs: str
    why: str
    enable: str
    off: Mapping[str, Any] = field(default_factory=dict)

    def changes_nothing(self, name: str, value: Any, default: Any) -> bool:
        """A value that asks for nothing this rule could ignore: the setting's default or its off value."""
        return value == default or (name in self.off and value == self.off[name])


# The trainer's settings (TrainConfig field names) that act only with another setting.
TRAIN_DEPENDENTS = (
    Dependent(
        ("student_init_expert",),
        lambda c: "teacher" in (c.student_init, c.critic_init),
        "--student_init teacher",
        "it picks the teacher expert whose blocks --student_init teacher (or --critic_init teacher) copies; "
        "any other start never reads it",
        "add --student_init teacher",
    ),
    Dependent(
        (
            "student_lora_alpha",
            "critic_lora_rank",
            "student_lora_init",
            "expert_phase",
            "student_lora_targets",
        ),
        lambda c: c.student_lora_rank > 0,
        "--student_lora_rank",
        "it shapes or starts the adapters of a LoRA student; without --student_lora_rank the run trains "
        "a separate student and has none",
        "add --student_lora_rank 64",
    ),
    Dependent(
        ("student_steps", "student_shift", "student_shift_terminal"),
        lambda c: c.few_step,
        "a few-step method (--method dmd, ode_init or self_forcing)",
        "it shapes the step grid of a few-step student; velocity distillation samples with the "
        "teacher's steps",
        "add --method dmd (from a trained student: README, the two-stage recipe)",
    ),
    Dependent(
        (
            "critic_config",
            "critic_init",
            "critic_updates",
            "critic_lr",
            "critic_betas",
            "generator_betas",
        ),
        lambda c: c.trains_critic,
        "--method dmd (or self_forcing)",
        "it is a setting of distribution matching (a few-step student and its critic); velocity "
        "distillation and ode_init train no critic",
        "add --method dmd (from a trained student: README, the two-stage recipe)",
    ),
    Dependent(
        ("dmd_inputs", "regression_weight"),
        lambda c: c.method == "dmd",
        "--method dmd",
        "it chooses the inputs or adds a term of dmd's generator update",
        "add --method dmd (from a trained student: README, the two-stage recipe)",
    ),
    Dependent(
        ("rollout_frames",),
        # At 0 or the clip's own length it asks for the rollout every causal run has.
        lambda c: c.method == "self_forcing" or not c.longer_rollout,
        "--method self_forcing",
        "it sets how far a causal student's training rollout streams; only Self-Forcing rolls the student out",
        "add --method self_forcing (with --student_chunk_frames; docs/streaming.md)",
        off={"rollout_frames": 0},
    ),
    Dependent(
        ("reference_prompts",),
        lambda c: (
            c.method == "self_forcing"
            or (c.method == "dmd" and c.dmd_inputs == "simulate" and not c.regression_weight)
        ),
        "--method dmd with --dmd_inputs simulate and no --regression_weight (or --method self_forcing)",
        "only such a run samples the teacher for a subset of the prompts; every other run samples "
        "one clean latent per training prompt",
        "use --method dmd without --dmd_inputs data and --regression_weight",
    ),
    Dependent(
        ("eval_prompts", "eval_num_buckets", "eval_samples_per_bucket"),
        lambda c: c.eval_interval > 0,
        "--eval_interval",
        "it shapes the student-vs-teacher report, which runs only every --eval_interval steps (0 = off)",
        "add --eval_interval 500",
    ),
    Dependent(
        ("sample_interval",),
        lambda c: c.save_samples,
        "--save_samples",
        "samples are rendered only with --save_samples",
        "add --save_samples",
    ),
    Dependent(
        ("sample_prompts", "sample_dir"),
        lambda c: c.save_samples or c.eval_interval > 0,
        "--save_samples (or --eval_interval)",
        "no samples or reports are rendered without one of them",
        "add --save_samples (or --eval_interval 500)",
    ),
    Dependent(
        ("wandb_mode", "wandb_run_name"),
        lambda c: bool(c.wandb_project),
        "--wandb_project",
        "nothing is sent to wandb without a project",
        "add --wandb_project NAME",
        off={"wandb_mode": "disabled"},
    ),
    Dependent(
        ("negative_prompt",),
        lambda c: max(c.guidance_scale, c.guidance_scale_2) > 1.0 or not c.negative_prompt,  # "": none
        "a guidance scale above 1",
        "the negative prompt feeds the unconditional branch of guidance, which does not run at guidance 1",
        "set --guidance_scale above 1 (Wan 2.2 A14B: 4.0)",
    ),
)


def second_expert_guidance(name: str, experts: int, model: str, scale_flag: str) -> Dependent:
    """The rule of a low-noise expert's guidance scale (`name`: the trainer's and evaluate's
    guidance_scale_2, generate's guidance_2) for a teacher with `experts` transformers.

    One rule for the three commands, so that what docs/ti2v-5b.md says holds for each: a teacher
    with one transformer (TI2V-5B) never reads a second scale, so any value given other than 1 (no
    guidance) is refused. Checked with no default for it: the trainer's 3.0 is the A14B low-noise
    expert's, and a one-transformer teacher has none, so a 3 the user wrote asks for something too.
    """
    return Dependent(
        (name,),
        lambda _settings: experts == 2,
        f"a teacher with two experts, and {model} has one transformer",
        f"{model} runs its one transformer at every timestep, guided by {scale_flag} alone",
        "",  # nothing to enable: this teacher has no second expert
        off={name: 1.0},
    )


def given_where(
    command_line: Iterable[str], config_keys: Iterable[str] = (), config: Any = None
) -> dict[str, str]:
    """Each setting the user gave, and how to name it: `--name` (command line) or 'name' in FILE."""
    where = {name: f"'{name}' in {config}" for name in config_keys}
    where.update({name: f"--{name}" for name in command_line})
    return where


def check_dependents(
    settings: Any,
    given: Mapping[str, str],
    rules: Iterable[Dependent],
    defaults: Mapping[str, Any] | None = None,
    stage: Stage = Stage.CONFIG,
) -> None:
    """Refuse the first setting of `given` (name -> how the user wrote it) whose rule is inactive,
    unless its value is its default (`defaults`: name -> the value it takes when left out) or the
    rule's off value."""
    defaults = defaults or {}
    unset = object()  # no default known: every value given counts
    for rule in rules:
        if rule.active(settings):
            continue
        for name in rule.names:
            if name in given and not rule.changes_nothing(
                name, getattr(settings, name), defaults.get(name, unset)
            ):
                raise DistillError(
                    f"{given[name]} needs {rule.needs}: without it the setting would be ignored",
                    f"{rule.why}.",
                    fixes=[f"{rule.enable}, or drop {given[name]}" if rule.enable else f"drop {given[name]}"],
                    stage=stage,
                )


def check_guidance(
    high: tuple[str, float], low: tuple[str, float] | None = None, stage: Stage = Stage.CONFIG
) -> None:
    """Refuse guidance scales that would not be applied as given (see the module docstring).

    `high` and `low` are (flag, value) of the high- and low-noise experts' scales (`low` None for one
    model). Every scale must be 1 (no guidance) or more, and the low-noise one may guide only when
    the high-noise one does.
    """
    for flag, value in (high, low) if low is not None else (high,):
        if value < 1.0:
            raise DistillError(
                f"{flag} must be 1 (no guidance) or more, got {value:g}",
                "Guidance is uncond + scale x (cond - uncond): below 1 it pulls away from the prompt (a "
                "negative scale inverts it), and WanPipeline, which samples the teacher and the student, "
                "treats every scale up to 1 as no guidance, so the value would not be applied as given.",
                fixes=[f"use {flag} 1 for no guidance, or a scale above 1 (Wan 2.2 A14B: 4.0 / 3.0)"],
                stage=stage,
            )
    if low is not None and low[1] > 1.0 >= high[1]:
        raise DistillError(
            f"{low[0]} {low[1]:g} would be ignored: {high[0]} is {high[1]:g}",
            "WanPipeline runs the unconditional pass only when the high-noise expert's scale is above 1, "
            "so the low-noise expert would sample without guidance.",
            fixes=[f"give {high[0]} a scale above 1 too (Wan 2.2 A14B: 4.0 / 3.0), or set {low[0]} 1"],
            stage=stage,
        )
