"""The model card (README.md with Hugging Face metadata) written into every exported folder.

WanPipeline's defaults (guidance 5.0, 50 steps, 480x832, max_sequence_length 512) sample a
distilled student wrongly: guidance above 1 applies classifier-free guidance a second time to a
student that learned the guided velocity, and another prompt length changes the output (no
attention mask). The card shows the one call that is right for this student, from its
`run_settings.json`, and the measured fidelity and speed-up when the run evaluated the student.

    write_model_card(folder, settings, "transformer", eval_result)   # student/, student_ema/
    write_model_card(folder, settings, "pipeline", eval_result)      # pipeline/
    write_model_card(folder, settings, "lora", eval_result)          # lora/, lora_ema/
    write_model_card(folder, settings, "merged", eval_result)        # merged/ (a pipeline folder)

The code in it comes from distill/sample/card_code.py.

A method with its own sampler records it in the RunSettings (num_inference_steps, scheduler,
scheduler_note) and the card follows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distill.models.student_kind import kind_named
from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TI2V_5B, TeacherKind
from distill.sample.card_code import learned_guidance, replaced, streaming_code, usage_code
from distill.sample.run_settings import RunSettings, write_run_settings

CARD_FILE = "README.md"
WAN_DEFAULTS = "guidance 5.0, 50 steps, 480x832, max_sequence_length 512"


def _guidance_advice(settings: RunSettings) -> str:
    if learned_guidance(settings):
        return (
            "Guidance above 1 applies classifier-free guidance a second time to a student that "
            "already learned the guided velocity."
        )
    return (
        "This student learned the teacher's velocity without guidance (teacher guidance 1), so its "
        "samples are the teacher's unguided ones, and it has no unconditional branch for guidance "
        "to push against. It is meant as stage 1 of `--method dmd`, which adds the teacher's "
        "guidance back through the real score (README, the two-stage recipe)."
    )


def teacher_model(settings: RunSettings) -> TeacherKind:
    """The teacher's Wan 2.2 model as the run recorded it (files without the record: T2V-A14B, or
    I2V-A14B for an image-to-video run, the only models there were)."""
    named = kind_named(settings.teacher_kind)
    if named is not None:
        return named
    return I2V_A14B if settings.takes_image else T2V_A14B


def short_name(settings: RunSettings) -> str:
    """How the card's title names the student's model and mode: T2V, I2V, TI2V-5B text to video, ..."""
    kind = teacher_model(settings)
    if kind == TI2V_5B:
        return f"TI2V-5B ({'image' if settings.takes_image else 'text'} to video)"
    return "I2V" if settings.takes_image else "T2V"


def card_metadata(settings: RunSettings) -> Any:
    """The card's YAML header as huggingface_hub's ModelCardData."""
    from huggingface_hub import ModelCardData

    task = "image-to-video" if settings.takes_image else "text-to-video"
    tags = ["wan", "wan2.2", task, "distillation", f"{settings.method}-distillation"]
    if teacher_model(settings) == TI2V_5B:
        tags.append("ti2v")
    if settings.num_frames == 1 and not settings.takes_image:
        tags.append("text-to-image")
    return ModelCardData(
        library_name="diffusers",
        pipeline_tag=task,
        base_model=settings.base_model,  # None (left out) when the teacher's hub id is unknown
        tags=tags,
    )


def _streaming_lines(settings: RunSettings, folder_ref: str) -> list[str]:
    return [
        "## Streaming",
        "",
        "Streaming needs the wan-distill project's sampler (docs/streaming.md): each chunk is denoised on a KV",
        "cache of the finished ones and decoded at once, and a clip may run longer than the student was trained on",
        "(whole chunks). Three times the trained clip, chunk by chunk:",
        "",
        "```python",
        streaming_code(settings, folder_ref).rstrip("\n"),
        "```",
        "",
        '`python -m distill.generate --student FOLDER --stream --prompt "..."` writes the same frames to an MP4 as',
        "they come and prints the time to the first frame. Past the trained length a causal student slows down;",
        "`--continue_with I2V_STUDENT --num_frames N` instead continues its clip hop after hop from the last frame",
        "with an image-to-video student (of Wan2.2-I2V-A14B), which keeps it moving.",
    ]


def _eval_section(result: Mapping[str, Any] | None) -> list[str]:
    if not result:
        return [
            "No evaluation ran with this export. `python -m distill.evaluate --student FOLDER` measures",
            "fidelity to the teacher and the speed-up (eval.json).",
        ]
    cost, sampler, denoiser = result["cost"], result["sampler"], result.get("denoiser")
    settings = result.get("settings", {})
    rows = [
        (
            "sampler: frame PSNR against the teacher, same noise (higher is better)",
            f"{sampler['frame_psnr_db']:.2f} dB",
        ),
        ("sampler: final-latent MSE against the teacher (lower is better)", f"{sampler['latent_mse']:.4g}"),
        ("speed-up in transformer forwards (teacher / student)", f"{cost['speedup_forwards']:.2f}x"),
        ("speed-up in sampling time (teacher / student)", f"{cost['speedup_seconds']:.2f}x"),
    ]
    if denoiser:
        rows.insert(
            0,
            (
                "denoiser: relative MSE to the guided teacher velocity (lower is better)",
                f"{denoiser['relative_mse']:.4g}",
            ),
        )
    where = (
        f"step {result.get('step')}, {result.get('num_prompts')} held-out prompts at "
        f"{settings.get('height')}x{settings.get('width')}, {settings.get('num_frames')} frame(s); teacher "
        f"{cost['teacher']['steps']} steps with guidance {cost['teacher']['guidance_scale']}, student "
        f"{cost['student']['steps']} steps at guidance 1"
    )
    return [
        f"Measured by the run's evaluation ({where}):",
        "",
        "| measure | value |",
        "|---|---:|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
        "Times depend on the device the run used; the forward counts hold anywhere.",
    ]


def _teacher_words(settings: RunSettings) -> str:
    if settings.one_transformer:
        return f"one transformer at every timestep, guidance {settings.teacher_guidance_scale}"
    return (
        f"both experts, switched at t = {settings.boundary_ratio} x 1000, guidance "
        f"{settings.teacher_guidance_scale} (high-noise) / {settings.teacher_guidance_scale_2} (low-noise)"
    )


def _teacher_lora_lines(settings: RunSettings) -> list[str]:
    """The user's LoRAs the teacher carried (--teacher_lora), fused at their scales."""
    experts = {"transformer": "the high-noise expert", "transformer_2": "the low-noise expert"}
    if settings.one_transformer:
        experts = {"transformer": "the transformer"}
    return [
        f"- teacher LoRA: `{Path(str(lora.get('file'))).name}` fused into {experts.get(lora.get('expert'), lora.get('expert'))} "
        f"at scale {lora.get('scale')} (sha256 {lora.get('sha256')}): the student learned the teacher with it"
        for lora in settings.teacher_loras
    ]


def _comfyui_lines(settings: RunSettings) -> list[str]:
    """How the speed LoRA and the user's LoRAs it was distilled against stack in ComfyUI."""
    if not settings.teacher_loras:
        return []
    models = {"transformer": "the high-noise model", "transformer_2": "the low-noise model"}
    files = {"transformer": "high_noise_lora.safetensors", "transformer_2": "low_noise_lora.safetensors"}
    if settings.one_transformer:
        models, files = {"transformer": "the model"}, {"transformer": "lora.safetensors"}
    lines = [
        "",
        "## With the LoRAs it was distilled against",
        "",
        "It was distilled against the teacher carrying the LoRAs below, so sample it with them loaded",
        "(above: both adapters active with `set_adapters`). In ComfyUI, chain two LoRA loaders",
        "(LoraLoaderModelOnly) on each model:",
        "",
    ]
    for expert, model in models.items():
        mine = [lora for lora in settings.teacher_loras if lora.get("expert") == expert]
        yours = ", then ".join(
            f"`{Path(str(lora.get('file'))).name}` at strength {lora.get('scale')}" for lora in mine
        )
        lines.append(
            f"- {model}: {yours or 'no user LoRA'}, then this folder's `comfyui/{files[expert]}` at strength 1"
        )
    return lines


def _trained(settings: RunSettings) -> str:
    """How many optimizer steps trained what: a LoRA run of one expert's adapters (--expert_phase)
    trained that expert's only, and holds the other's as its run started."""
    steps = f"{settings.trained_steps} optimizer steps"
    if settings.expert_phase is None:
        return steps
    other = {"high": "low", "low": "high"}[settings.expert_phase]
    return (
        f"{steps} of the {settings.expert_phase}-noise expert's adapters only; the {other}-noise "
        "expert's are kept as the run started, from --student_lora_init or else at zero"
    )


def model_card_text(
    settings: RunSettings, kind: str, folder_ref: str, eval_result: Mapping[str, Any] | None = None
) -> str:
    """The whole README.md: metadata header, the exact call, what it was trained on, measurements."""
    from huggingface_hub import ModelCard

    teacher = settings.base_model or settings.teacher_path
    sampler = settings.scheduler_note or (
        f"the teacher's scheduler{' ' + settings.scheduler['_class_name'] if settings.scheduler else ''} "
        f"with {settings.num_inference_steps} steps (more steps follow the teacher more closely, fewer are faster)"
    )
    what = {
        "pipeline": "pipeline folder",
        "lora": "LoRA adapters",
        "merged": "LoRA adapters merged into the experts",
    }.get(kind, "transformer")
    if kind == "lora" and settings.one_transformer:
        about = [
            f"A LoRA adapter for the one transformer of `{teacher}` ({settings.method} distillation, "
            f"{settings.trained_steps} optimizer steps): the teacher itself with the adapter, one forward",
            "per step and no classifier-free guidance at sampling time. `comfyui/` holds the same adapter in",
            "Wan key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, with `.alpha`) for ComfyUI",
            "and other Wan-format tools, at strength 1.",
        ]
    elif kind == "lora":
        about = [
            f"LoRA adapters for both experts of `{teacher}` ({settings.method} distillation, "
            f"{_trained(settings)}): the teacher itself, one adapter per expert, one forward",
            "per step and no classifier-free guidance at sampling time. `comfyui/` holds the same adapters in",
            "Wan key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, with `.alpha`) for ComfyUI",
            "and other Wan-format tools; load the high-noise file on the high-noise model, the low-noise file",
            "on the low-noise model, at strength 1.",
        ]
    elif kind == "merged":
        experts = "the one transformer" if settings.one_transformer else "both experts"
        about = [
            f"The LoRA student of `{teacher}` ({settings.method} distillation, {_trained(settings)}) "
            f"with its adapters merged into {experts}: standalone",
            "`WanTransformer3DModel` weights, one forward per step and no classifier-free guidance at sampling",
            f"time. A pipeline folder: `{settings.pipeline_class}.from_pretrained` loads it with the teacher's text",
            "encoder, tokenizer and VAE (links to the teacher's folders) and the run's own scheduler.",
            *(
                [
                    "The LoRAs the teacher carried (under Training) are in these weights too, at their scales:",
                    "do not load them again.",
                ]
                if settings.teacher_loras
                else []
            ),
        ]
    else:
        about = [
            f"A compact `WanTransformer3DModel` distilled from `{teacher}` ({settings.method} distillation,",
            f"{settings.trained_steps} optimizer steps). It replaces {replaced(settings)}: one model, one forward",
            "per step, no classifier-free guidance at sampling time.",
        ]
    if settings.takes_image:
        about += [
            "",
            f"It turns an image into a video, as the teacher does: every call of `{settings.pipeline_class}`",
            "takes the first frame as `image=` (resized to height x width by the pipeline, as in training).",
        ]
    if teacher_model(settings) == TI2V_5B:
        other = (
            "text to video (`WanPipeline`)"
            if settings.takes_image
            else "image to video (`WanImageToVideoPipeline`)"
        )
        about += [
            "",
            f"The teacher, Wan2.2-TI2V-5B, has two modes; this student was distilled in "
            f"{'image' if settings.takes_image else 'text'} to video only",
            f"(`{settings.pipeline_class}`, `expand_timesteps` true: a timestep per token). It has not learned {other}.",
        ]
    if settings.chunk_frames:
        about += [
            "",
            f"It is causal: its attention is block-causal over chunks of {settings.chunk_frames} latent frame(s)",
            "(`causal_config.json`), so it streams, each chunk's frames out while the next is made, and",
            "clips may run longer than trained (Streaming, below).",
            *(
                [
                    "Stock diffusers and ComfyUI apply the adapters to the teacher's experts attending over the",
                    "whole clip at once, which is not what they were trained for.",
                ]
                if kind == "lora"
                else [
                    "Stock diffusers loads the weights as a bidirectional model, which is not what it was trained to be."
                ]
            ),
        ]
    body = [
        f"# Wan 2.2 {short_name(settings)} distilled student ({what})",
        "",
        *about,
        "",
        "## Sampling",
        "",
        f"Do not use {settings.pipeline_class}'s defaults ({WAN_DEFAULTS}). {_guidance_advice(settings)}",
        f"{settings.pipeline_class} uses no attention mask over the padded prompt, so another max_sequence_length",
        "gives another output. This is the call it was trained for:",
        "",
        "```python",
        usage_code(settings, kind, folder_ref).rstrip("\n"),
        "```",
        "",
        f"- guidance_scale **{settings.guidance_scale}**, num_inference_steps **{settings.num_inference_steps}**, "
        f"max_sequence_length **{settings.max_sequence_length}**",
        f"- trained at **{settings.height}x{settings.width}**, **{settings.num_frames}** frame(s); other sizes are "
        "untested (and sizes beyond its rope_max_seq_len fail)",
        f"- sampler: {sampler}",
        "",
        '`python -m distill.generate --student FOLDER --prompt "..."'
        + (" --image first_frame.png" if settings.takes_image else "")
        + " --output out.png` of the wan-distill",
        "project uses these values by default (from `run_settings.json` in this folder).",
        "",
        *(_streaming_lines(settings, folder_ref) if settings.chunk_frames else []),
        *(_comfyui_lines(settings) if kind == "lora" else []),
        "",
        "## Training",
        "",
        f"- teacher: `{teacher}` ({_teacher_words(settings)}), negative prompt {settings.negative_prompt!r}",
        *_teacher_lora_lines(settings),
        f"- clean latents from {settings.teacher_sample_steps} teacher steps; training timesteps with flow "
        f"shift {settings.flow_shift}",
        "",
        "## Evaluation",
        "",
        *_eval_section(eval_result),
    ]
    header = card_metadata(settings).to_yaml()
    return str(ModelCard(f"---\n{header}\n---\n\n" + "\n".join(body) + "\n"))


def write_model_card(
    folder: str | Path,
    settings: RunSettings,
    kind: str,
    eval_result: Mapping[str, Any] | None = None,
    folder_ref: str | None = None,
) -> Path:
    """Write `folder`/README.md; `folder_ref` is how the code refers to the folder (default: its
    absolute path, so the call runs as shown from anywhere on this machine)."""
    folder = Path(folder)
    path = folder / CARD_FILE
    tmp = path.with_name(f".{CARD_FILE}.{os.getpid()}.tmp")
    tmp.write_text(model_card_text(settings, kind, folder_ref or str(folder.resolve()), eval_result))
    os.replace(tmp, path)
    return path


def latest_eval(eval_dir: str | Path, ema: bool) -> dict[str, Any] | None:
    """The newest eval.json under `eval_dir` (<output_dir>/eval/step_*/) made with (or without) EMA weights."""
    for path in sorted(Path(eval_dir).glob("step_*/eval.json"), reverse=True):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a damaged report is no reason to fail an export
        if bool(result.get("ema")) == ema:
            return result
    return None


def document_export(
    output_dir: str | Path,
    settings: RunSettings,
    student_dir: Path | None,
    ema_dir: Path | None = None,
    pipeline_dir: Path | None = None,
    student_kind: str = "transformer",
    merged_dir: Path | None = None,
) -> list[Path]:
    """run_settings.json beside and inside every exported folder, and a model card in each of them.

    The pipeline/ folder runs the EMA student when there is one (as the trainer links it), and so
    does a LoRA run's merged/ pipeline folder (the EMA adapters merged in when there are some).
    `student_kind` is "lora" when the student folders hold adapters.
    """
    output_dir = Path(output_dir)
    folders: Sequence[tuple[Path | None, str, bool]] = (
        (student_dir, student_kind, False),
        (ema_dir, student_kind, True),
        (pipeline_dir, "pipeline", ema_dir is not None),
        (merged_dir, "merged", ema_dir is not None),
    )
    written = write_run_settings(settings, output_dir)
    for folder, kind, ema in folders:
        if folder is None or not folder.is_dir():
            continue
        written += write_run_settings(settings, folder)
        written.append(write_model_card(folder, settings, kind, latest_eval(output_dir / "eval", ema)))
    return written
