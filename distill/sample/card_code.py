"""The Python a model card shows, each piece runnable as written (the cards' tests run it): the stock
pipeline call that samples the exported student right (from its `run_settings.json`), and for a
causal student the code that streams it with this project's sampler.

    usage_code(settings, "lora", folder_ref)     # the stock diffusers call for lora/
    streaming_code(settings, folder_ref)          # open_stream over 3x the trained clip
"""

from __future__ import annotations

from pathlib import Path

from distill.sample.run_settings import RunSettings

EXAMPLE_PROMPT = "a red fox trotting through fresh snow at sunrise"
EXAMPLE_IMAGE = "first_frame.png"
# Wan 2.2's VAEs make one latent frame of every 4 video frames after the first.
VAE_TEMPORAL = 4


def learned_guidance(settings: RunSettings) -> bool:
    """Whether the student already carries the teacher's guidance: a dmd student always (its real
    score is the guided teacher), a velocity student when the teacher it learned was guided."""
    guided = max(settings.teacher_guidance_scale, settings.teacher_guidance_scale_2 or 1.0) > 1.0
    return settings.method != "velocity" or guided


def replaced(settings: RunSettings) -> str:
    """What the student stands in for: both experts of an A14B teacher, or TI2V-5B's one transformer."""
    return "the teacher's transformer" if settings.one_transformer else "both teacher experts"


def usage_code(settings: RunSettings, kind: str, folder_ref: str) -> str:
    """The Python that samples this student correctly; runs as it is (the card's test runs it).

    `kind` is "transformer" (a student/ folder: the pipeline is assembled from the teacher),
    "pipeline" (a pipeline/ folder that loads with WanPipeline.from_pretrained alone), "lora" (the
    adapters, loaded onto the teacher) or "merged" (a LoRA run's merged/ pipeline folder).
    """
    pipeline = settings.pipeline_class
    lines = [
        "import numpy as np",
        "import torch",
        f"from diffusers import {pipeline}, WanTransformer3DModel",
        f"from diffusers.utils import export_to_video{', load_image' if settings.takes_image else ''}",
        "from PIL import Image",
        "",
        "dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32",
    ]
    if kind in ("pipeline", "merged"):
        lines += [
            "# this folder: its path here, or the hub id it was uploaded to",
            f"pipe = {pipeline}.from_pretrained({folder_ref!r}, torch_dtype=dtype)",
        ]
    elif kind == "lora" and settings.one_transformer:
        lines += [
            "# the teacher itself, with its adapter (this folder: its path, or the hub id it was uploaded to)",
            f"pipe = {pipeline}.from_pretrained({settings.teacher_path!r}, torch_dtype=dtype)",
            f'pipe.load_lora_weights({folder_ref!r}, weight_name="lora.safetensors", adapter_name="fast")',
        ]
    elif kind == "lora":
        lines += [
            "# the teacher itself, with one adapter per expert (this folder: its path, or the hub id it was uploaded to)",
            f"pipe = {pipeline}.from_pretrained({settings.teacher_path!r}, torch_dtype=dtype)",
            f'pipe.load_lora_weights({folder_ref!r}, weight_name="high_noise_lora.safetensors", adapter_name="fast")',
            "pipe.load_lora_weights(",
            f'    {folder_ref!r}, weight_name="low_noise_lora.safetensors", adapter_name="fast_2",',
            "    load_into_transformer_2=True,",
            ")",
        ]
    else:
        lines += [
            "# this folder: its path here, or the hub id it was uploaded to",
            f"student = WanTransformer3DModel.from_pretrained({folder_ref!r}, torch_dtype=dtype)",
            "# tokenizer, text encoder, VAE and scheduler come from the teacher; the student replaces "
            + replaced(settings),
            f"pipe = {pipeline}.from_pretrained(",
            f"    {settings.teacher_path!r},",
            "    transformer=student,",
            "    transformer_2=None,",
            "    boundary_ratio=None,",
            "    torch_dtype=dtype,",
            ")",
        ]
    if kind == "lora":
        lines += user_adapter_lines(settings)
    if settings.scheduler and kind not in ("pipeline", "merged"):  # a pipeline folder already holds it
        name = settings.scheduler["_class_name"]
        config = {k: v for k, v in settings.scheduler.items() if not k.startswith("_")}
        lines += [
            f"from diffusers import {name}",
            "",
            f"pipe.scheduler = {name}.from_config({dict(sorted(config.items()))!r})",  # a Python literal, not JSON
        ]
    lines.append('pipe.to("cuda" if torch.cuda.is_available() else "cpu")')
    if settings.takes_image:
        lines += [
            "# the video's first frame: a file or URL (the pipeline resizes it to height x width)",
            f"image = load_image({EXAMPLE_IMAGE!r})",
        ]
    lines += [
        "result = pipe(",
        *(["    image=image,"] if settings.takes_image else []),
        f"    prompt={EXAMPLE_PROMPT!r},",
        f"    height={settings.height},",
        f"    width={settings.width},",
        f"    num_frames={settings.num_frames},",
        f"    num_inference_steps={settings.num_inference_steps},",
        f"    guidance_scale={settings.guidance_scale!r},  # "
        + (
            "the student learned the guided velocity"
            if learned_guidance(settings)
            else "distilled without guidance"
        ),
        f"    max_sequence_length={settings.max_sequence_length},  # as in training: the padding changes the output",
        '    generator=torch.Generator("cpu").manual_seed(0),',
        '    output_type="np",',
        ")",
        "frames = result.frames[0]  # (frames, height, width, 3) in [0, 1]",
    ]
    if settings.num_frames == 1:
        lines.append('Image.fromarray((frames[0] * 255).round().astype(np.uint8)).save("sample.png")')
    else:
        lines.append('export_to_video(list(frames), "sample.mp4", fps=16)')
    return "\n".join(lines) + "\n"


def streaming_code(settings: RunSettings, folder_ref: str) -> str:
    """The Python that streams a causal student with the wan-distill project's sampler, 3x the
    trained clip (whole chunks); runs as it is (the causal students' tests run it)."""
    latent_frames = (settings.num_frames - 1) // VAE_TEMPORAL + 1
    frames = (3 * latent_frames - 1) * VAE_TEMPORAL + 1
    flags = ["--student", folder_ref, "--prompt", EXAMPLE_PROMPT, "--num_frames", str(frames)]
    if settings.takes_image:
        flags += ["--image", EXAMPLE_IMAGE]
    return (
        "\n".join(
            [
                "from diffusers.utils import export_to_video",
                "",
                "from distill.generate import open_stream",
                "",
                "# generate's flags; the teacher, size and steps come from the run (run_settings.json)",
                f"stream = open_stream({flags!r})",
                "clip = []",
                "for frames in stream.chunks(0, seed=0):  # each chunk's frames, as soon as it is made",
                "    clip.extend(frames)  # (height, width, 3) in [0, 1]: show or send them now",
                'export_to_video(clip, "stream.mp4", fps=16)',
            ]
        )
        + "\n"
    )


def user_adapter_lines(settings: RunSettings) -> list[str]:
    """A speed LoRA distilled against a teacher with the user's LoRAs samples that model: the user's
    files loaded beside it as adapters, each at the scale it was fused at, all active together."""
    if not settings.teacher_loras:
        return []
    names = ["fast"] if settings.one_transformer else ["fast", "fast_2"]
    weights = [1.0] * len(names)
    lines = [
        "# the LoRAs it was distilled against, as adapters beside the speed LoRA (at their scales);",
        "# peft warns that the model then holds several adapters: here that is the point",
    ]
    for index, lora in enumerate(settings.teacher_loras):
        path = Path(str(lora.get("file")))
        second = lora.get("expert") == "transformer_2"
        name = f"user_{index}"
        lines.append(
            f"pipe.load_lora_weights({str(path.parent)!r}, weight_name={path.name!r}, adapter_name={name!r}"
            + (", load_into_transformer_2=True)" if second else ")")
        )
        names.append(name)
        weights.append(float(lora.get("scale", 1.0)))
    lines.append(f"pipe.set_adapters({names!r}, adapter_weights={weights!r})")
    return lines
