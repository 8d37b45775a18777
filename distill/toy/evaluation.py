"""Score teacher and student on the toy world: sampling through WanPipeline, reading the pictures
(or clips: `num_frames` > 1 samples clip prompts and scores their motion too).

    from distill.toy.evaluation import sample_pictures, score_pictures, toy_report
    pictures = sample_pictures(teacher_path, prompts, transformer=high, transformer_2=low,
                               steps=20, guidance_scale=4.0, guidance_scale_2=3.0)
    score_pictures(pictures, prompts)["accuracy"]
    clips = sample_pictures(teacher_path, eval_prompts(clips=True), ..., num_frames=9)  # (N, 9, H, W, 3)

Everything goes through stock diffusers: the teacher folder's tokenizer, text encoder, VAE and
scheduler, `WanPipeline` with both experts (or the student alone, boundary_ratio None), prompts
in batches. Prompt i starts from the noise of seed `seed + i` (`distill.models.pipelines.initial_noise`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.models.lora import RoutedModel
from distill.models.pipelines import encode_on_needed_tokens
from distill.toy import world
from distill.toy.score import score_any

# Every prompt of the world once. A slice of 48 left about +-0.07 of sampling noise: one 4-step
# student read 0.85 on the first 48 and 0.70 on all 216. Smaller counts are a fixed shuffled slice.
EVAL_PROMPTS = 216
# 9 motions x 24: each motion as often as any other.
EVAL_CLIP_PROMPTS = 216


def eval_prompts(count: int = EVAL_PROMPTS, seed: int = 0, clips: bool = False) -> list[str]:
    """`count` grammar prompts in a fixed shuffled order (repeats after all of them). Clip prompts
    (`clips`) cycle through the motions, so any 9 in a row hold every motion once."""
    if not clips:
        prompts = world.all_prompts()
        order = np.random.default_rng(seed).permutation(len(prompts))
        return [prompts[order[i % len(prompts)]] for i in range(count)]
    rng = np.random.default_rng(seed)
    scenes = world.all_prompts()
    order = rng.permutation(len(scenes))
    motions = world.motions()
    chosen = []
    for i in range(count):
        attributes = world.parse_prompt(scenes[order[i % len(scenes)]])
        direction, speed = motions[i % len(motions)]
        chosen.append(world.prompt_of(**attributes, direction=direction, speed=speed))
    return chosen


def frames_of(teacher_path: str | Path, clips: bool) -> int:
    """Frames per sample: 1 for pictures, the teacher's clip length for clips."""
    if not clips:
        return 1
    return int((world.read_world(teacher_path) or {}).get("clip_frames") or world.CLIP_FRAMES)


def load_parts(teacher_path: str | Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Tokenizer, text encoder and VAE of a teacher folder (float32, frozen)."""
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    path = Path(teacher_path)
    return {
        "tokenizer": AutoTokenizer.from_pretrained(path / "tokenizer"),
        "text_encoder": UMT5EncoderModel.from_pretrained(path / "text_encoder").eval().to(device),
        "vae": AutoencoderKLWan.from_pretrained(path / "vae").eval().to(device),
    }


def load_experts(teacher_path: str | Path, device: torch.device | str = "cpu") -> tuple[Any, Any]:
    from diffusers import WanTransformer3DModel

    path = Path(teacher_path)
    return tuple(
        WanTransformer3DModel.from_pretrained(path / name).eval().requires_grad_(False).to(device)
        for name in ("transformer", "transformer_2")
    )


# (teacher folder, its text encoder's file stamp, prompts) -> (prompt embeddings, empty-negative ones)
_EMBEDDINGS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default, which the toy world is sampled at


def prompt_embeddings(
    pipe: Any, teacher_path: Path, prompts: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """WanPipeline's own embeddings of `prompts` and of as many empty negative prompts, kept for the
    process per teacher and prompt list: the scorer samples the same prompts again and again (teacher
    and students, at several step counts). Encoded on the tokens the prompts need, padded after
    (distill.models.pipelines.encode_on_needed_tokens): 512 tokens each were 44% of a clip scoring. The text encoder's file stamp is part of the key: another teacher in the same folder
    is encoded anew."""
    weights = teacher_path / "text_encoder" / "model.safetensors"
    stamp = (weights.stat().st_mtime_ns, weights.stat().st_size) if weights.is_file() else None
    key = (str(teacher_path.resolve()), stamp, tuple(prompts))
    if key not in _EMBEDDINGS:
        if len(_EMBEDDINGS) >= 32:
            _EMBEDDINGS.clear()
        _EMBEDDINGS[key] = encode_on_needed_tokens(
            pipe, prompts, MAX_SEQUENCE_LENGTH, pipe.text_encoder.device, negative=True
        )
    return _EMBEDDINGS[key]


@torch.no_grad()
def sample_pictures(
    teacher_path: str | Path,
    prompts: Sequence[str],
    *,
    transformer: torch.nn.Module,
    transformer_2: torch.nn.Module | None = None,
    steps: int,
    guidance_scale: float = 1.0,
    guidance_scale_2: float | None = None,
    seed: int = 0,
    size: int | None = None,
    batch: int = 64,
    parts: dict[str, Any] | None = None,
    scheduler: Any | None = None,
    num_frames: int = 1,
) -> np.ndarray:
    """Pictures (N, H, W, 3) in [0, 1] from WanPipeline, or clips (N, F, H, W, 3) when
    `num_frames` > 1: both experts when `transformer_2` is given (switched at the teacher's
    boundary_ratio), else `transformer` alone. `scheduler` replaces the teacher's (a dmd
    student's K-step one: its re-noising comes from the global RNG, seeded here with `seed`)."""
    import json

    from diffusers import WanPipeline

    from distill.models.pipelines import initial_noise, load_scheduler

    if isinstance(transformer, RoutedModel) and transformer_2 is None:
        # a LoRA student: the teacher's experts with its adapters, switched as the teacher's are
        transformer, transformer_2 = transformer.sampling_experts()
        guidance_scale_2 = guidance_scale
    path = Path(teacher_path)
    parts = parts or load_parts(path, transformer.device)
    boundary = json.loads((path / "model_index.json").read_text()).get("boundary_ratio")
    description = world.read_world(path) or {}
    size = size or int(description.get("height", 32))
    pipe = WanPipeline(
        **parts,
        scheduler=scheduler if scheduler is not None else load_scheduler(path),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=boundary if transformer_2 is not None else None,
    )
    pipe.set_progress_bar_config(disable=True)
    shape = (16, (num_frames - 1) // 4 + 1, size // 8, size // 8)
    pictures = []
    for start in range(0, len(prompts), batch):
        chunk = list(prompts[start : start + batch])
        noise = torch.cat([initial_noise(shape, seed + start + i) for i in range(len(chunk))])
        if getattr(pipe.scheduler.config, "stochastic_sampling", False):
            torch.manual_seed(seed + start)  # reproducible re-noising (scheduler.step gets no generator)
        embeddings, negative = prompt_embeddings(pipe, path, chunk)
        frames = pipe(
            prompt_embeds=embeddings,
            negative_prompt_embeds=negative,
            height=size,
            width=size,
            num_frames=num_frames,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2 if transformer_2 is not None else None,
            latents=noise.to(transformer.device),
            output_type="np",
        ).frames
        frames = np.asarray(frames)
        pictures.append(frames[:, 0] if num_frames == 1 else frames)
    return np.concatenate(pictures).astype(np.float32)


def score_pictures(pictures: np.ndarray, prompts: Sequence[str]) -> dict[str, Any]:
    """`distill.toy.score.score` (accuracy, per_attribute, diversity_gap, ...), or `score_clips`
    (the same plus motion_ratio, still_leak, jitter, identity) for clips (N, F, H, W, 3)."""
    return score_any(list(pictures), list(prompts))


MOTION_FIGURES = ("motion_ratio", "motion_ratio_per_speed", "still_leak", "jitter", "identity")


def _entry(result: dict[str, Any], steps: int, guidance: Sequence[float]) -> dict[str, Any]:
    return {
        "accuracy": result["accuracy"],
        "diversity_gap": result["diversity_gap"],
        "per_attribute": result["per_attribute"],
        "wasserstein": result["wasserstein"],
        **{name: result[name] for name in MOTION_FIGURES if name in result},
        "steps": steps,
        "guidance_scale": list(guidance),
        "count": result["count"],
    }


def toy_report(
    teacher_path: str | Path,
    student: torch.nn.Module,
    high: torch.nn.Module,
    low: torch.nn.Module,
    *,
    student_steps: int,
    guidance_scale: float,
    guidance_scale_2: float,
    count: int = EVAL_PROMPTS,
    seed: int = 0,
    student_scheduler: Any | None = None,
    num_frames: int = 1,
    show: Callable[[Sequence[str], list[tuple[str, np.ndarray]]], None] | None = None,
) -> dict[str, Any]:
    """eval.json["toy"]: `teacher` (its full steps and guidance), `teacher_at_student_steps` and
    `student` (guidance 1, with `student_scheduler` if it has its own, e.g. a dmd student's K-step
    one), each with accuracy, diversity_gap and per-attribute accuracy; on clips (`num_frames` > 1)
    the clip prompts, with direction and speed among the attributes and the motion figures. `show`
    receives the prompts and the samples as (label, samples) rows, e.g. to write them for people."""
    description = world.read_world(teacher_path) or {}
    full_steps = int(description.get("sample_steps", 20))
    prompts = eval_prompts(count, clips=num_frames > 1)
    parts = load_parts(teacher_path, student.device)
    guided = {
        "guidance_scale": guidance_scale,
        "guidance_scale_2": guidance_scale_2,
        "num_frames": num_frames,
    }

    def teacher(steps: int) -> np.ndarray:
        return sample_pictures(
            teacher_path,
            prompts,
            transformer=high,
            transformer_2=low,
            steps=steps,
            seed=seed,
            parts=parts,
            **guided,
        )

    student_pictures = sample_pictures(
        teacher_path,
        prompts,
        transformer=student,
        steps=student_steps,
        seed=seed,
        parts=parts,
        scheduler=student_scheduler,
        num_frames=num_frames,
    )
    both = (guidance_scale, guidance_scale_2)
    full_samples = teacher(full_steps)
    # Same noise, steps and guidance give the same pictures: sample the teacher once then.
    short_samples = full_samples if student_steps == full_steps else teacher(student_steps)
    full = score_pictures(full_samples, prompts)
    at_student_steps = full if student_steps == full_steps else score_pictures(short_samples, prompts)
    if show is not None:
        show(
            prompts,
            [
                (f"teacher {full_steps} steps", full_samples),
                (f"teacher {student_steps} steps", short_samples),
                (f"student {student_steps} steps", student_pictures),
            ],
        )
    return {
        "prompts": count,
        "num_frames": num_frames,
        "teacher": _entry(full, full_steps, both),
        "teacher_at_student_steps": _entry(at_student_steps, student_steps, both),
        "student": _entry(score_pictures(student_pictures, prompts), student_steps, (1.0,)),
        "chance": score_pictures(student_pictures[:1], prompts[:1])["chance"],
        "better": {"accuracy": "higher", "diversity_gap": "lower"},
    }


def calibrate(teacher_path: str | Path, count: int = 96, clips: bool = False) -> dict[str, Any]:
    """The numbers of the README table for a trained toy teacher (world, teacher with and without
    guidance, at 4 and 1 steps, and an untrained student), on pictures or on clips."""
    from distill.toy.render import render_batch, render_clips

    description = world.read_world(teacher_path) or {}
    full = int(description.get("sample_steps", 20))
    g1, g2 = world.guidance_of(description, clips)
    num_frames = frames_of(teacher_path, clips)
    prompts = eval_prompts(count, clips=clips)
    high, low = load_experts(teacher_path)
    parts = load_parts(teacher_path)
    rng = np.random.default_rng(1)
    scenes = [world.scene_for(p, rng) for p in prompts]
    truth = render_clips(scenes, frames=num_frames) if clips else render_batch(scenes)
    results = {"world": score_pictures(truth, prompts)}
    runs = {
        f"teacher_{full}_steps_guided": (full, g1, g2),
        f"teacher_{full}_steps_unguided": (full, 1.0, 1.0),
        "teacher_4_steps_guided": (4, g1, g2),
        "teacher_1_step_guided": (1, g1, g2),
    }
    for name, (steps, a, b) in runs.items():
        pictures = sample_pictures(
            teacher_path,
            prompts,
            transformer=high,
            transformer_2=low,
            steps=steps,
            guidance_scale=a,
            guidance_scale_2=b,
            parts=parts,
            num_frames=num_frames,
        )
        results[name] = score_pictures(pictures, prompts)
    # A random student (the experts' shape, untrained, guidance 1): where distillation starts from.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        untrained = type(high).from_config(high.config).eval()
    pictures = sample_pictures(
        teacher_path, prompts, transformer=untrained, steps=full, parts=parts, num_frames=num_frames
    )
    results[f"untrained_student_{full}_steps"] = score_pictures(pictures, prompts)
    return {
        name: {
            "accuracy": r["accuracy"],
            "diversity_gap": None if r["diversity_gap"] is None else round(r["diversity_gap"], 3),
            "per_attribute": r["per_attribute"],
            **{k: _rounded(r[k]) for k in ("motion_ratio", "still_leak", "jitter", "identity") if k in r},
        }
        for name, r in results.items()
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def score_table(rows: Sequence[Mapping[str, Any]], clips: bool) -> str:
    """A markdown table of toy score rows (each with its `model`, `steps` and `guidance`): accuracy and
    diversity gap, and for clips direction, speed and motion ratio."""
    head = "| model | steps | guidance | accuracy | diversity gap |"
    rule = "|---|---:|---:|---:|---:|"
    if clips:
        head += " direction | speed | motion ratio |"
        rule += "---:|---:|---:|"
    lines = [head, rule]
    for r in rows:
        cells = [
            r["model"],
            str(r["steps"]),
            " / ".join(f"{g:g}" for g in r["guidance"]),
            f"{r['accuracy']:.2f}",
            _cell(r["diversity_gap"]),
        ]
        if clips:
            cells += [
                _cell(r["per_attribute"]["direction"]),
                _cell(r["per_attribute"]["speed"]),
                _cell(r.get("motion_ratio")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
