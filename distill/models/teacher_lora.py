"""The user's own LoRAs on the teacher (`--teacher_lora PATH[:SCALE]`, repeatable): which expert each
file is for, whether it fits this teacher, and fusing it into the frozen expert as it loads.

Files are read by diffusers' own Wan LoRA reader (`WanLoraLoaderMixin.lora_state_dict`), which turns
the Wan/ComfyUI form (`diffusion_model.` keys, lora_down/lora_up, alphas) and musubi-tuner/kohya's
`lora_unet_` keys into diffusers keys; peft loads the result as an adapter, `fuse_lora` merges it
at its scale and `unload_lora` leaves plain (fused) layers. After that the expert is an ordinary
frozen model: placement (cpu, gpu, shard), caches and methods never see that it was changed.

Which expert a file is for (Wan 2.2 LoRAs come per expert):
- a file whose name has the word `high` (`x_high_noise.safetensors`, `x_HIGH_fp16.safetensors`) is
  for the high-noise expert (`transformer`), one with `low` for the low-noise expert (`transformer_2`);
- a file with neither goes on both experts (what a ComfyUI user does with a single LoRA), or on the
  one transformer of a teacher without a boundary (TI2V-5B);
- a folder holds one pair (one `high` file and one `low` file at its top, as our own `lora/` export
  does), or, for a one-transformer teacher, exactly one file (our `lora.safetensors`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distill.models.lora_files import FILES, KIND_KEY, ONE_FILE
from distill.models.student_kind import kind_named
from distill.models.teacher_kind import TeacherKind
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

FLAG = "--teacher_lora"
HIGH, LOW = "transformer", "transformer_2"
# The model a LoRA was made for, told by the width of the blocks it adapts (attn1.to_q's input).
WIDTHS = {
    1536: "Wan 2.1 T2V-1.3B (width 1536)",
    3072: "Wan2.2-TI2V-5B (width 3072)",
    5120: "a 14B Wan: Wan 2.1 14B or Wan 2.2 A14B (width 5120)",
}


@dataclass(frozen=True)
class TeacherLora:
    """One LoRA file fused into one expert at one scale."""

    path: Path
    scale: float
    expert: str  # "transformer" (high noise, or the one transformer) or "transformer_2" (low noise)
    sha256: str  # of the whole file: another content is another teacher

    def record(self) -> dict[str, Any]:
        """What caches, checkpoints and run_settings.json keep of it (the path is for people only)."""
        return {"file": str(self.path), "expert": self.expert, "scale": self.scale, "sha256": self.sha256}


def _refusal(title: str, details: str, fixes: list[str]) -> DistillError:
    return DistillError(title, details, fixes=fixes, stage=Stage.CONFIG)


def split_spec(spec: str) -> tuple[Path, float]:
    """(path, scale) of `PATH[:SCALE]`; the scale is 1 when left out. A path that exists as written
    is a path even if it holds a colon."""
    path_text, scale_text = spec, None
    if not Path(spec).exists() and ":" in spec:
        head, tail = spec.rsplit(":", 1)
        if "/" not in tail and "\\" not in tail:
            path_text, scale_text = head, tail
    path = Path(path_text).expanduser()
    if scale_text is None:
        return path, 1.0
    try:
        scale = float(scale_text)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise _refusal(
            f"{FLAG} {spec}: the scale {scale_text!r} is not a finite number",
            "The part after the last ':' is the strength the LoRA is fused at (1 when left out).",
            [f"{FLAG} {path_text}:1.0   (or any finite number, e.g. 0.8; {FLAG} {path_text} means 1)"],
        )
    return path, scale


def _expert_words(path: Path) -> set[str]:
    words = set(re.split(r"[^a-z0-9]+", path.stem.lower()))
    return {w for w in ("high", "low") if w in words or f"{w}noise" in words}


def _file_lora(path: Path, scale: float, experts: int, spec: str) -> list[tuple[Path, float, str]]:
    if path.suffix != ".safetensors":
        raise _refusal(
            f"{FLAG} {spec}: {path.name} is not a .safetensors file",
            "LoRAs are read from safetensors files (pickled .pt/.ckpt files can run code when loaded).",
            [f"convert it to .safetensors and pass {FLAG} {path.with_suffix('.safetensors')}"],
        )
    words = _expert_words(path)
    if experts == 1 or not words:
        return [(path, scale, HIGH)] + ([(path, scale, LOW)] if experts == 2 else [])
    if len(words) == 2:
        raise _refusal(
            f"{FLAG} {spec}: the name {path.name} says both high and low: which expert is it for?",
            "A file named with `high` goes on the high-noise expert, one with `low` on the low-noise "
            "expert, one with neither on both.",
            [f"rename it (e.g. {path.stem}_high_noise.safetensors) and pass it again"],
        )
    return [(path, scale, HIGH if words == {"high"} else LOW)]


def _folder_lora(folder: Path, scale: float, experts: int, spec: str) -> list[tuple[Path, float, str]]:
    files = sorted(folder.glob("*.safetensors"))
    by_word = {w: [f for f in files if _expert_words(f) == {w}] for w in ("high", "low")}
    if experts == 1:
        if len(files) == 1:
            return [(files[0], scale, HIGH)]
        pair = " (a Wan 2.2 A14B high/low pair)" if by_word["high"] and by_word["low"] else ""
        raise _refusal(
            f"{FLAG} {spec}: the folder holds {len(files)} .safetensors files{pair}; this teacher has one "
            "transformer and takes one file",
            "Files: " + (", ".join(f.name for f in files) or "none"),
            [f"pass the one file for this model: {FLAG} {folder / 'NAME.safetensors'}"],
        )
    if len(by_word["high"]) == 1 and len(by_word["low"]) == 1:
        return [(by_word["high"][0], scale, HIGH), (by_word["low"][0], scale, LOW)]
    if len(files) == 1 and not _expert_words(files[0]):
        return [(files[0], scale, HIGH), (files[0], scale, LOW)]
    if len(by_word["high"]) + len(by_word["low"]) == 1:
        have, missing = ("high", "low") if by_word["high"] else ("low", "high")
        only = by_word[have][0]
        raise _refusal(
            f"{FLAG} {spec}: half a pair: the folder has a {have}-noise LoRA ({only.name}) and no "
            f"{missing}-noise one",
            "A Wan 2.2 A14B LoRA comes as two files, one per expert; a folder is read as that pair.",
            [
                f"put the {missing}-noise file (its name with `{missing}`) beside it in {folder}",
                f"or change the {have}-noise expert only: {FLAG} {only}",
            ],
        )
    raise _refusal(
        f"{FLAG} {spec}: cannot tell the pair in this folder",
        "A folder must hold one file named with `high` and one with `low` (or a single file for both "
        "experts). Files: " + (", ".join(f.name for f in files) or "none"),
        [
            f"pass the files one by one: {FLAG} FOLDER/X_high_noise.safetensors {FLAG} FOLDER/X_low_noise.safetensors"
        ],
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def parse_teacher_loras(specs: Sequence[str], experts: int) -> tuple[TeacherLora, ...]:
    """Each `PATH[:SCALE]` of the flag as the LoRAs it fuses, per expert, in the order given."""
    found: list[TeacherLora] = []
    for spec in specs:
        path, scale = split_spec(spec)
        if not path.exists():
            raise _refusal(
                f"{FLAG} {spec}: {path} does not exist",
                "",
                [
                    f"check the path (a .safetensors file or a folder of a high/low pair), then pass {FLAG} again"
                ],
            )
        parts = (_folder_lora if path.is_dir() else _file_lora)(path, scale, experts, spec)
        found.extend(TeacherLora(p.resolve(), s, e, _sha256(p)) for p, s, e in parts)
    return tuple(found)


def read_lora(lora: TeacherLora) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The file's tensors in diffusers keys (`transformer.blocks...`) and its adapter metadata, as
    diffusers' Wan LoRA reader converts them."""
    from diffusers.loaders import WanLoraLoaderMixin

    try:
        state, metadata = WanLoraLoaderMixin.lora_state_dict(
            str(lora.path.parent), weight_name=lora.path.name, return_lora_metadata=True
        )
    except Exception as exc:
        raise _refusal(
            f"{FLAG} {lora.path}: cannot read it as a Wan LoRA",
            f"{type(exc).__name__}: {exc}",
            [f"re-download {lora.path.name} (a cut-short file cannot be read), then pass {FLAG} again"],
        ) from None
    # A plain peft state dict (no `transformer.` prefix) is the transformer's too.
    state = {
        (k if k.startswith("transformer.") else "transformer." + k.removeprefix("base_model.model.")): v
        for k, v in state.items()
    }
    return state, metadata


def _modules(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """module name -> (in, out) features of the LoRA keys of `state`."""
    found: dict[str, list[int]] = {}
    for key, value in state.items():
        name, _, rest = key.removeprefix("transformer.").partition(".lora_")
        entry = found.setdefault(name, [-1, -1])
        if rest == "A.weight":
            entry[0] = int(value.shape[-1])
        elif rest == "B.weight":
            entry[1] = int(value.shape[0])
    return {name: (a, b) for name, (a, b) in found.items()}


def _looks_made_for(modules: Mapping[str, tuple[int, int]]) -> str:
    if any(".attn2.add_k_proj" in name for name in modules):
        return "Wan 2.1 image to video (it adapts the image cross-attention, which Wan 2.2 has not)"
    widths = [shape[0] for name, shape in modules.items() if name.endswith("attn1.to_q")]
    blocks = {name.split(".")[1] for name in modules if name.startswith("blocks.")}
    if not widths:
        return "unknown"
    return WIDTHS.get(widths[0], f"a model of width {widths[0]}") + f", {len(blocks)} blocks adapted"


def check_fit(
    lora: TeacherLora, state: Mapping[str, torch.Tensor], model: torch.nn.Module, teacher: str
) -> None:
    """Refuse a LoRA whose modules are not all in `model` with the same shapes: a LoRA of another
    model would otherwise be half applied (peft skips what it cannot find)."""
    modules = _modules(state)
    have = dict(model.named_modules())
    misfits = []
    for name, (n_in, n_out) in modules.items():
        layer = have.get(name)
        if layer is None:
            misfits.append(f"{name}: no such module in {teacher}")
        elif (getattr(layer, "in_features", n_in), getattr(layer, "out_features", n_out)) != (n_in, n_out):
            misfits.append(
                f"{name}: the LoRA is {n_in} -> {n_out}, the teacher's layer "
                f"{layer.in_features} -> {layer.out_features}"
            )
    if not misfits and modules:
        return
    raise _refusal(
        f"{FLAG} {lora.path} is not a LoRA of this teacher ({teacher}): "
        f"{len(modules) - len(misfits)} of {len(modules)} adapted modules match its {lora.expert}",
        "It looks made for: "
        + _looks_made_for(modules)
        + "\n"
        + "\n".join(misfits[:5])
        + (f"\n... and {len(misfits) - 5} more" if len(misfits) > 5 else ""),
        [
            f"pass a LoRA trained for {teacher} (for Wan 2.2 A14B: its high/low pair)",
            f"or drop {FLAG} {lora.path} to distil the teacher without it",
        ],
    )


def check_loras_fit(
    loras: Sequence[TeacherLora], configs: Mapping[str, Mapping[str, Any]], teacher: str
) -> None:
    """Every LoRA checked against an empty (meta-device) model of its expert's config: a misfit is
    refused before anything is loaded or written."""
    from diffusers import WanTransformer3DModel

    shells: dict[str, torch.nn.Module] = {}
    for lora in loras:
        if lora.expert not in shells:
            with torch.device("meta"):
                shells[lora.expert] = WanTransformer3DModel.from_config(dict(configs[lora.expert]))
        check_fit(lora, read_lora(lora)[0], shells[lora.expert], teacher)


def fuse_teacher_loras(
    model: torch.nn.Module, expert: str, loras: Sequence[TeacherLora], teacher: str
) -> None:
    """Fuse the LoRAs of `expert` into `model` at their scales, one at a time (a scale applies to one
    adapter only), leaving plain frozen layers."""
    for index, lora in enumerate(x for x in loras if x.expert == expert):
        state, metadata = read_lora(lora)
        check_fit(lora, state, model, teacher)
        name = f"teacher_lora_{index}"
        model.load_lora_adapter(state, prefix="transformer", adapter_name=name, metadata=metadata)
        model.fuse_lora(lora_scale=lora.scale, adapter_names=[name])
        model.unload_lora()
        logger.info("fused %s into the teacher's %s at scale %g", lora.path, expert, lora.scale)
    model.requires_grad_(False)


def recorded_kind(path: Path) -> tuple[str, str] | None:
    """(value, where) of the teacher model one of our LoRA exports records (KIND_KEY): the file's own
    metadata (lora/comfyui/), else the adapter_config.json beside one of our file names (lora/);
    None for a file that records none (every LoRA made elsewhere)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            value = (handle.metadata() or {}).get(KIND_KEY)
    except Exception:  # unreadable: read_lora names it
        value = None
    if isinstance(value, str) and value:
        return value, f"{path} (its metadata): {KIND_KEY} = {value}"
    config = path.parent / "adapter_config.json"
    if path.name not in (*FILES.values(), *ONE_FILE.values()) or not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get(KIND_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return (value, f"{config}: {KIND_KEY} = {value}") if isinstance(value, str) and value else None


def check_recorded_kinds(loras: Sequence[TeacherLora], kind: TeacherKind, teacher_path: Path) -> None:
    """Refuse an export of this trainer made for another Wan 2.2 model than the teacher's: the LoRA
    layers of the T2V-A14B and I2V-A14B experts have the same shapes, so only its record tells."""
    for lora in loras:
        recorded = recorded_kind(lora.path)
        other = kind_named(recorded[0]) if recorded else None
        if recorded is None or other is None or other == kind:
            continue
        raise _refusal(
            f"{FLAG} {lora.path}: a LoRA of {other.model} ({other.task}); this teacher is {kind.model} "
            f"({kind.task})",
            f"recorded: {recorded[1]}\nthis teacher: {teacher_path}\nIts layers have the same shapes on "
            f"both models' experts, so it would load, but it learned {other.model}'s input ({other.inputs}).",
            [
                f"pass a LoRA trained for {kind.model}, or drop {FLAG} {lora.path}",
                f"or use it on the teacher it was made for: --teacher_path (a {other.model} folder)",
            ],
        )


def from_records(
    records: Sequence[Mapping[str, Any]], where: Path, kind: TeacherKind
) -> tuple[TeacherLora, ...]:
    """The LoRAs a run recorded (run_settings.json `teacher_loras`, written by `TeacherLora.record`),
    each file still there with the content it had: a file missing or changed since is refused naming
    it, with the flags that name it again or leave it out."""
    # The flags that name the same files again (a folder's pair as its two files, each file once).
    named = dict.fromkeys((Path(str(r.get("file"))), float(r.get("scale", 1.0))) for r in records)
    again = " ".join(f"{FLAG} NEW/PATH/{file.name}:{scale!r}" for file, scale in named)
    loras = []
    for record in records:
        path, scale = Path(str(record.get("file"))), float(record.get("scale", 1.0))
        if record.get("expert") not in (HIGH, LOW)[: kind.experts]:
            raise _refusal(
                f"{where} records a LoRA for the teacher's {record.get('expert')}, which {kind.model} has not",
                f"{path.name}: the run that made the student had a teacher of another model.",
                [f"pass the run's --teacher_path, or compare with this teacher bare: {FLAG} none"],
            )
        if not path.is_file():
            raise _refusal(
                f"{path.name}, a LoRA the student's teacher carried, is gone: {path}",
                f"{where} (teacher_loras) says the student was distilled against the teacher with it fused "
                f"into {record.get('expert')} at scale {scale!r} (sha256 {record.get('sha256')}); the teacher's "
                "reference needs it to be that teacher.",
                [f"pass where the files are now: {again}", f"or compare with the bare teacher: {FLAG} none"],
            )
        sha256 = _sha256(path)
        if sha256 != record.get("sha256"):
            raise _refusal(
                f"{path} has changed since the student was distilled against it",
                f"{where} (teacher_loras) recorded sha256 {record.get('sha256')}; the file now has {sha256}.",
                [
                    "put back the file the run used, or pass the ones you mean: "
                    + " ".join(f"{FLAG} {file}:{scale!r}" for file, scale in named),
                    f"or compare with the bare teacher: {FLAG} none",
                ],
            )
        loras.append(TeacherLora(path.resolve(), scale, str(record.get("expert")), sha256))
    return tuple(loras)
