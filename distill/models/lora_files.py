"""The LoRA student's adapter files, in the two key formats people load.

    lora/high_noise_lora.safetensors            diffusers keys (transformer.blocks.N.attn1.to_q.lora_A.weight)
    lora/low_noise_lora.safetensors             with rank, alpha and targets in the file's metadata
    lora/comfyui/high_noise_lora.safetensors    Wan keys (diffusion_model.blocks.N.self_attn.q.lora_down.weight,
    lora/comfyui/low_noise_lora.safetensors     .lora_up.weight and .alpha), as ComfyUI, LightX2V and Wan tools read

diffusers loads the first pair with `pipe.load_lora_weights(folder, weight_name=..., adapter_name=...)`
(`load_into_transformer_2=True` for the low-noise file). A teacher with one transformer (TI2V-5B)
has one file per format, `lora.safetensors` (`ONE_FILE`, the same keys): the only weights file in
lora/, so `pipe.load_lora_weights(folder)` finds it without a weight_name. The Wan-format files always carry an
alpha per module, so no tool has to guess the strength; each is checked on writing by converting
it back with diffusers' own converter for such files and comparing every module's weight change.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from distill.models.causal.layout import CausalLayout, write_causal_config
from distill.models.lora import LoraShape
from distill.models.original.keymaps import transformer_to_original
from distill.models.teacher_kind import TeacherKind
from distill.ops.errors import DistillError, Stage
from distill.ops.files import staging_folder, swap_into_place

FILES = {"high": "high_noise_lora.safetensors", "low": "low_noise_lora.safetensors"}
# The one transformer of a teacher without a boundary ("high" in routing: `transformer`).
ONE_FILE = {"high": "lora.safetensors"}
WAN_FORMAT_DIR = "comfyui"
LORA_SUFFIXES = {"lora_A": "lora_down", "lora_B": "lora_up"}
# merged/: where each expert with the adapters merged in is written (the teacher's own subfolders).
MERGED_SUBFOLDERS = {"high": "transformer", "low": "transformer_2"}
# The key under which a LoRA folder records its teacher's model (TeacherKind.name): in
# adapter_config.json and in the Wan-format files' metadata.
KIND_KEY = "teacher_kind"


def lora_files(experts: Sequence[str]) -> dict[str, str]:
    """expert -> file name of a LoRA folder for these experts: both A14B experts, or the one
    transformer ("high" alone, ONE_FILE)."""
    if tuple(experts) == ("high",):
        return dict(ONE_FILE)
    return {which: FILES[which] for which in experts}


def module_of(key: str) -> tuple[str, str]:
    """`blocks.0.attn1.to_q.lora_A.weight` -> (`blocks.0.attn1.to_q`, `lora_A`)."""
    module, kind, _ = key.rsplit(".", 2)
    return module, kind


def wan_module_name(module: str) -> str:
    """The Wan (original layout) name of a diffusers module: blocks.0.attn1.to_q -> blocks.0.self_attn.q."""
    (renamed,) = transformer_to_original({f"{module}.weight": None})
    return renamed[: -len(".weight")]


def to_wan_format(state: Mapping[str, torch.Tensor], shape: LoraShape) -> dict[str, torch.Tensor]:
    """diffusers-named adapter tensors -> Wan-format keys with lora_down / lora_up and an alpha per module."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module, kind = module_of(key)
        name = f"diffusion_model.{wan_module_name(module)}"
        out[f"{name}.{LORA_SUFFIXES[kind]}.weight"] = tensor.detach().float().contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(shape.alpha))
    return out


def weight_changes(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """module -> scale * B @ A: what the adapter adds to each weight."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, kind = module_of(key.removeprefix("transformer."))
        parts.setdefault(module, {})[kind] = tensor.float()
    return {m: scale * p["lora_B"] @ p["lora_A"] for m, p in parts.items()}


def wan_format_problem(
    state: Mapping[str, torch.Tensor], shape: LoraShape, wan: Mapping[str, torch.Tensor]
) -> str | None:
    """None if diffusers' converter for Wan-format LoRAs reads `wan` back to the weight changes of
    `state` (alpha included), else what differs."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    converted = _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in wan.items()})
    # the converter folds alpha / rank into the tensors, so its own scale is 1
    back = weight_changes(converted, 1.0)
    want = weight_changes(state, shape.alpha / shape.rank)
    if set(back) != set(want):
        missing, extra = sorted(set(want) - set(back)), sorted(set(back) - set(want))
        return f"modules differ: missing {missing[:3]}, unexpected {extra[:3]}"
    for module, delta in want.items():
        if not torch.allclose(back[module], delta, rtol=1e-5, atol=1e-7):
            return f"{module}: weight change differs by {float((back[module] - delta).abs().max()):.3g}"
    return None


def save_wan_format(
    state: Mapping[str, torch.Tensor],
    shape: LoraShape,
    path: Path,
    what: str,
    fix: str,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """`state` (diffusers-named adapter tensors, float32 on the CPU) saved at `path` in Wan's keys,
    once diffusers' own converter reads them back as trained; else refused naming `what` with `fix`."""
    from safetensors.torch import save_file

    wan = to_wan_format(state, shape)
    problem = wan_format_problem(state, shape, wan)
    if problem:
        raise DistillError(
            f"{what} does not read back as trained", problem, fixes=[fix], stage=Stage.INTERNAL
        )
    save_file(wan, path, metadata={"format": "pt", **(metadata or {})})


def write_lora_folder(
    states: Mapping[str, Mapping[str, torch.Tensor]],
    shape: LoraShape,
    out_dir: str | Path,
    kind: TeacherKind | None = None,
) -> Path:
    """Write `out_dir` (see the module docstring) from {"high": state, "low": state} in diffusers key
    names ({"high": state} for one transformer); staged next to it and renamed into place, so a
    crash never leaves half a folder.

    `kind`, the teacher's model, is recorded in adapter_config.json and in the Wan-format files'
    metadata (distill.models.lora_folder.KIND_KEY): both models' experts have the same layer shapes,
    so only this record tells an image-to-video LoRA from a text-to-video one."""
    from diffusers import WanPipeline

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(out_dir)
    metadata = {"r": shape.rank, "lora_alpha": shape.alpha, "target_modules": list(shape.targets)}
    # Kept out of the diffusers files' adapter metadata: diffusers builds its LoRA config from that.
    recorded = {KIND_KEY: kind.name} if kind is not None else {}
    names = lora_files(tuple(states))
    try:
        (staging / WAN_FORMAT_DIR).mkdir()
        for which, state in states.items():
            plain = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
            WanPipeline.save_lora_weights(
                staging,
                transformer_lora_layers=plain,
                weight_name=names[which],
                transformer_lora_adapter_metadata=metadata,
            )
            save_wan_format(
                plain,
                shape,
                staging / WAN_FORMAT_DIR / names[which],
                f"the Wan-format {which}-noise LoRA",
                "use the diffusers-format files beside it, and report this with the run's lora/ folder",
                recorded,
            )
        (staging / "adapter_config.json").write_text(json.dumps({**metadata, **recorded}, indent=2) + "\n")
        swap_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def is_lora_folder(folder: str | Path) -> bool:
    """Whether `folder` holds any file of a LoRA folder: it is then read as one, and
    distill.models.lora_folder names whatever is missing or wrong in it."""
    folder = Path(folder)
    return any(
        (folder / name).is_file() for name in (*FILES.values(), *ONE_FILE.values(), "adapter_config.json")
    )


def merged_state(expert: torch.nn.Module, adapter: str, keep: bool = True) -> dict[str, torch.Tensor]:
    """The expert's weights with adapter `adapter` added in (W + scale B A), in its own key names.

    A sharded expert (FSDP2) is gathered one tensor at a time, a collective: every rank calls this,
    and only the one that writes keeps the tensors (`keep`; the others return {})."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from torch.distributed.tensor import DTensor

    deltas = {
        name: module.get_delta_weight(adapter)
        for name, module in expert.named_modules()
        if isinstance(module, LoraLinear) and adapter in module.lora_A
    }
    state = {}
    for key, tensor in expert.state_dict().items():
        if ".lora_" in key:
            continue
        if isinstance(tensor, DTensor):
            # The gathered tensor may be a view of a padded gather buffer: own storage for safetensors.
            tensor = tensor.full_tensor().clone()
        if not keep:
            continue
        module, _, leaf = key.rpartition(".base_layer.")
        if module and leaf == "weight" and module in deltas:
            tensor = (tensor.float() + deltas[module].float()).to(tensor.dtype)
        state[key.replace(".base_layer.", ".")] = tensor.detach().cpu().contiguous()
    return state


def write_merged_experts(
    experts: Mapping[str, torch.nn.Module],
    adapter: str,
    out_dir: str | Path,
    states: Mapping[str, dict[str, torch.Tensor]] | None = None,
    causal: CausalLayout | None = None,
) -> Path:
    """`out_dir`/transformer and `out_dir`/transformer_2: both experts with the adapter merged in, as
    standalone diffusers models (for users who want no adapters at all); `out_dir`/transformer alone
    for a teacher with one transformer (`experts` without "low"). Staged and renamed.
    `states`: the merged weights when already gathered (`merged_state`, sharded experts).
    `causal`: a causal LoRA student's layout, recorded in `out_dir` and beside each expert's config
    (causal_config.json), so each loads causal again and the folder streams."""
    from huggingface_hub import save_torch_state_dict

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(out_dir)
    try:
        for which, subfolder in MERGED_SUBFOLDERS.items():
            expert = experts.get(which)
            if expert is None:  # the one transformer of TI2V-5B: no transformer_2
                continue
            target = staging / subfolder
            target.mkdir()
            save_torch_state_dict(
                states[which] if states is not None else merged_state(expert, adapter),
                target,
                filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
            )
            expert.save_config(target)
            if causal is not None:
                write_causal_config(target, causal)
        if causal is not None:
            write_causal_config(staging, causal)
        swap_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
