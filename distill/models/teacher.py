"""The frozen Wan 2.2 teacher: find it, read its layout, load its parts, and give guided velocities.

Only what a stage needs is loaded: the text encoder to fill the embedding cache (then freed), the
two experts for sampling clean latents and for training targets, the VAE only to decode samples.
Expert convention (diffusers' WanPipeline): `transformer` is the HIGH-noise expert and handles
t >= boundary_ratio * 1000; `transformer_2` is the LOW-noise expert and handles the rest.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from distill.models.layout import (
    CONFIG_PATTERNS,
    ORIGINAL_COMPONENTS,
    components_without_weights,
    diffusers_components,
    missing_components,
    present_entries,
    safetensors_problem,
)
from distill.models.original.convert import ensure_converted
from distill.models.original.detect import looks_original
from distill.models.teacher_kind import (
    T2V_A14B,
    TeacherKind,
    folder_kind,
    refuse_undistillable,
    resume_command,
)
from distill.models.teacher_lora import (
    TeacherLora,
    check_loras_fit,
    check_recorded_kinds,
    fuse_teacher_loras,
    parse_teacher_loras,
)
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


# ---------------------------------------------------------------------------------------------
# Finding the teacher and reading its layout (cheap: JSON only)
# ---------------------------------------------------------------------------------------------


def _layout_error(path: str, title: str, details: str = "", kind: TeacherKind = T2V_A14B) -> DistillError:
    folder = Path(path)
    found = present_entries(folder)
    lines = [details] if details else []
    lines.append(
        f"Expected the diffusers layout ({kind.repo_id}): " + ", ".join(diffusers_components(kind.experts))
    )
    lines.append("or the original Wan layout: " + ", ".join(ORIGINAL_COMPONENTS))
    lines.append(
        "Found: " + (", ".join(found) if found else "nothing (the folder does not exist or is empty)")
    )
    return DistillError(
        title,
        "\n".join(lines),
        causes=["the download did not finish", "--teacher_path points at the wrong folder"],
        fixes=[
            # An incomplete folder of this model resumes in place; anything else downloads anew.
            (
                f"{kind.download_command(path)}   # completes it"
                if folder_kind(path) == kind
                else f"{kind.download_command()}   # then pass {kind.default_folder}"
            ),
            f"python download_wan.py --verify {path}   # lists what is missing",
            f"{kind.tiny_command('models/tiny-wan')}   # a tiny random teacher to try the pipeline",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def resolve_teacher_path(path_or_id: str, configs_only: bool = False) -> Path:
    """A local folder as is; a hub id is fetched (or found in the local hub cache) with huggingface_hub:
    whole, or with `configs_only` (a --dry_run plan) only its JSON configs, a few KB."""
    local = Path(path_or_id).expanduser()
    if local.exists() or not HUB_ID.match(path_or_id):
        if not local.is_dir():
            raise _layout_error(path_or_id, f"teacher folder not found: {path_or_id}")
        return local.resolve()
    from huggingface_hub import snapshot_download

    patterns = {"allow_patterns": list(CONFIG_PATTERNS)} if configs_only else {}
    try:
        cached = Path(snapshot_download(path_or_id, local_files_only=True, **patterns))
        # A cache holding only the configs (an earlier dry run) is no teacher to train with.
        if configs_only or not components_without_weights(cached):
            return cached
    except Exception:  # not cached yet: fetch it below
        pass
    try:
        fetched = Path(snapshot_download(path_or_id, **patterns))
        if not configs_only and components_without_weights(fetched):  # offline, the cache is all there is
            raise FileNotFoundError(f"{fetched} holds the teacher's configs but no weights")
        return fetched
    except Exception as exc:
        what = "the configs of the teacher" if configs_only else "the teacher"
        raise DistillError(
            f"could not fetch {what} {path_or_id} from the Hugging Face hub",
            f"{type(exc).__name__}: {exc}",
            causes=[
                "no network on this node",
                "the repo is gated and no token is set",
                "a typo in the repo id",
            ],
            fixes=[
                f"download once on a machine with internet: python download_wan.py --repo_id {path_or_id} "
                f"--local_dir models/teacher{' --configs_only' if configs_only else ''}, copy the folder "
                "here, then pass --teacher_path models/teacher",
                "set HF_TOKEN if the repo is gated",
            ],
            stage=Stage.TEACHER_LOAD,
        ) from None


def _read_json(path: Path, teacher: Path) -> dict[str, Any]:
    """A JSON file of the teacher folder `teacher` (model_index.json at its top, the components'
    configs one level down): the fixes name that folder, wherever the file sits in it."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DistillError(
            f"cannot read {path}",
            str(exc),
            fixes=[
                f"re-download that file: {resume_command(teacher)}  (resumes, fetching only what is "
                "missing or wrong)",
                f"python download_wan.py --verify {teacher}",
            ],
            stage=Stage.TEACHER_LOAD,
        ) from None


@dataclass(frozen=True)
class TeacherInfo:
    """What the rest of the trainer needs to know about the teacher, read from its JSON files."""

    path: Path
    # Where `transformer` hands over to `transformer_2` (t >= ratio * 1000 runs `transformer`); None
    # for a teacher with one transformer (TI2V-5B), which runs at every timestep.
    boundary_ratio: float | None
    flow_shift: float
    # Config of `transformer`. The low-noise expert must agree on channels, text width and patch;
    # its depth may differ (the toy teacher's is deeper), and the memory plan sizes both like this one.
    expert_config: dict[str, Any]
    vae_scale_spatial: int
    vae_scale_temporal: int
    # Which Wan 2.2 model, read from its files (models/teacher_kind.py): only distillable kinds get here.
    kind: TeacherKind = T2V_A14B
    # The user's LoRAs fused into the experts as they load (--teacher_lora): part of the teacher.
    loras: tuple[TeacherLora, ...] = ()

    @property
    def expert_folders(self) -> tuple[str, ...]:
        """The teacher's transformer folders: ("transformer", "transformer_2"), or ("transformer",)."""
        return ("transformer", "transformer_2") if self.kind.experts == 2 else ("transformer",)

    @property
    def latent_channels(self) -> int:
        # The noisy latents only: an image-to-video input adds its condition channels to them.
        return int(self.expert_config.get("out_channels") or self.expert_config["in_channels"])

    @property
    def text_dim(self) -> int:
        return int(self.expert_config["text_dim"])

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.expert_config["patch_size"])

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int, int]:
        frames = (num_frames - 1) // self.vae_scale_temporal + 1
        return (
            self.latent_channels,
            frames,
            height // self.vae_scale_spatial,
            width // self.vae_scale_spatial,
        )

    def tokens(self, height: int, width: int, num_frames: int) -> int:
        """Transformer tokens of one sample of this size (latent frames x patches)."""
        _, frames, rows, columns = self.latent_shape(height, width, num_frames)
        patch = self.patch_size
        return (frames // patch[0]) * (rows // patch[1]) * (columns // patch[2])

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Host memory one rank needs to load both experts in `dtype` (from the files' sizes)."""
        on_disk = sum(
            f.stat().st_size for c in self.expert_folders for f in (self.path / c).glob("*.safetensors")
        )
        stored_dtype_bytes = 2 if self.expert_config.get("_stored_in_16_bit", True) else 4
        return on_disk * (torch.finfo(dtype).bits // 8) // stored_dtype_bytes

    def fingerprint(self, *components: str, with_loras: bool = True) -> str:
        """A content key for `components`: configs, file names and sizes, and the first and last MiB
        of every weight file. Cheap on 60 GB of weights, yet two differently initialised teachers
        of the same shape never share a cache. The LoRAs fused into an expert of `components` count
        as its content (each file's hash, expert and scale); without LoRAs the key is as it was."""
        digest = hashlib.sha256()
        fused = [lora for lora in self.loras if lora.expert in components] if with_loras else []
        for lora in fused:
            digest.update(f"lora {lora.expert} {lora.scale!r} {lora.sha256}".encode())
        for component in components:
            folder = self.path / component
            for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                digest.update(str(file.relative_to(self.path)).encode())
                size = file.stat().st_size
                digest.update(str(size).encode())
                with file.open("rb") as handle:
                    digest.update(handle.read(1 << 20))
                    if size > 2 << 20:
                        handle.seek(-(1 << 20), 2)
                        digest.update(handle.read())
        return digest.hexdigest()[:16]


def check_teacher_configs(path: Path, experts: int = 2) -> tuple[dict[str, Any] | None, ...]:
    """(transformer, transformer_2, scheduler, vae) configs, each value of the type its class expects
    (the text encoder's config is checked too); transformer_2's is None for a one-transformer teacher."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config

    from distill.models.config_types import check_value_types

    def read(relative: str, cls: type) -> dict[str, Any]:
        file = path / relative
        return check_value_types(_read_json(file, path), cls, file, Stage.TEACHER_LOAD)

    read("text_encoder/config.json", UMT5Config)
    return (
        read("transformer/config.json", WanTransformer3DModel),
        read("transformer_2/config.json", WanTransformer3DModel) if experts == 2 else None,
        read("scheduler/scheduler_config.json", UniPCMultistepScheduler),
        read("vae/config.json", AutoencoderKLWan),
    )


def _refuse_undistillable_hub_id(path_or_id: str) -> None:
    """A hub id of a model this version cannot distil is refused from its configs (a few KB), before
    the whole repository (~120 GB) is fetched. Any failure to get them is left to the whole fetch,
    which reports it with the fixes of a training run."""
    if Path(path_or_id).expanduser().exists() or not HUB_ID.match(path_or_id):
        return
    try:
        configs = resolve_teacher_path(path_or_id, configs_only=True)
    except DistillError:
        return
    refuse_undistillable(configs, shown=path_or_id)


def inspect_teacher(
    path_or_id: str,
    boundary_ratio: float | None = None,
    convert_dir: str | Path | None = None,
    configs_only: bool = False,
    loras: list[str] | None = None,
) -> TeacherInfo:
    """Resolve the teacher and read its layout, refusing anything that is not a complete Wan 2.2 T2V teacher.

    A folder in the ORIGINAL Wan layout is converted once to the diffusers layout under
    `convert_dir` (default: $WAN_DISTILL_CONVERT_DIR or ~/.cache/wan-distill/converted) and the
    returned info points at that copy, so every later stage reads the diffusers layout. With
    `configs_only` (a --dry_run plan) a hub id is fetched without its weights. `loras`: the
    --teacher_lora values, read and checked now (see `with_teacher_loras`).
    """
    if not configs_only:
        _refuse_undistillable_hub_id(path_or_id)
    path = resolve_teacher_path(path_or_id, configs_only)
    # The kind first: a folder of another Wan 2.2 model is told so, not that it misses this one's parts.
    reading = refuse_undistillable(path, shown=path_or_id)
    if looks_original(path):
        path = ensure_converted(path, convert_dir)
    kind = reading.kind if reading is not None else T2V_A14B
    missing = missing_components(path, diffusers_components(kind.experts))
    if missing:
        raise _layout_error(
            str(path), f"the teacher folder is incomplete: missing {', '.join(missing)}", kind=kind
        )
    index = _read_json(path / "model_index.json", path)
    ratio = _boundary_ratio(path, index, boundary_ratio, kind)
    high, low, scheduler, vae = check_teacher_configs(path, kind.experts)
    for key in ("in_channels", "out_channels", "text_dim", "patch_size"):
        if low is not None and high.get(key) != low.get(key):
            raise DistillError(
                f"the two experts disagree on {key}: transformer has {high.get(key)}, transformer_2 has {low.get(key)}",
                "Both experts of a Wan 2.2 teacher work in the same latent and text space.",
                fixes=["re-download the teacher; the folders come from different models"],
                stage=Stage.TEACHER_LOAD,
            )
    for component in ("text_encoder", "vae", *(("transformer", "transformer_2")[: kind.experts])):
        for weights in sorted((path / component).glob("*.safetensors")):
            problem = safetensors_problem(weights)
            if problem:
                raise DistillError(
                    f"the teacher's {component} weights are damaged: {weights}",
                    problem,
                    causes=["an interrupted download or copy", "a full disk while writing"],
                    fixes=[
                        f"re-download {component}/: {kind.download_command(path)}  (resumes, fetching "
                        "only what is missing or wrong)",
                        f"python download_wan.py --verify {path}",
                    ],
                    stage=Stage.TEACHER_LOAD,
                )
    temporal = vae.get("scale_factor_temporal") or 2 ** sum(
        bool(d) for d in vae.get("temperal_downsample", [])
    )
    spatial = vae.get("scale_factor_spatial") or 2 ** len(vae.get("temperal_downsample", [0, 0, 0]))
    info = TeacherInfo(
        path=path,
        boundary_ratio=ratio,
        flow_shift=float(scheduler.get("flow_shift") or scheduler.get("shift") or 3.0),
        expert_config=high,
        vae_scale_spatial=int(spatial),
        vae_scale_temporal=int(temporal),
        kind=kind,
    )
    return with_teacher_loras(info, loras)


def _boundary_ratio(path: Path, index: dict[str, Any], flag: float | None, kind: TeacherKind) -> float | None:
    """The expert switch: --boundary_ratio, else model_index.json's; None for one transformer."""
    if kind.experts == 1:
        if flag is not None:
            raise DistillError(
                f"--boundary_ratio {flag} was given, but {kind.model} has one transformer: there is no "
                "expert switch to move",
                fixes=["drop --boundary_ratio (and boundary_ratio from the config file)"],
                stage=Stage.CONFIG,
            )
        return None
    ratio = flag if flag is not None else index.get("boundary_ratio")
    if ratio is None:
        raise DistillError(
            f"{path}/model_index.json has no boundary_ratio: this is not a two-expert Wan 2.2 teacher",
            fixes=[
                "point --teacher_path at Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                "or pass --boundary_ratio 0.875",
            ],
            stage=Stage.TEACHER_LOAD,
        )
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
        raise DistillError(
            f'{path / "model_index.json"}: "boundary_ratio" must be a number (like 0.875), got {ratio!r}',
            fixes=[f'write "boundary_ratio": 0.875 in {path / "model_index.json"}, or pass --boundary_ratio'],
            stage=Stage.TEACHER_LOAD,
        )
    return float(ratio)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _load_failure(component: str, path: Path, exc: Exception) -> DistillError:
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        raise exc  # handled by the out-of-memory report of the entry point
    return DistillError(
        f"could not load the teacher's {component} from {path / component}",
        f"{type(exc).__name__}: {exc}",
        causes=[
            "a truncated or corrupt weight file (interrupted download)",
            "a diffusers/transformers version mismatch",
        ],
        fixes=[f"python download_wan.py --verify {path}", "re-download the damaged component"],
        stage=Stage.TEACHER_LOAD,
    )


def load_text_encoder(info: TeacherInfo, device: torch.device, dtype: torch.dtype) -> Any:
    """A WanPipeline holding only tokenizer and text encoder: its encode_prompt is the reference encoding."""
    from diffusers import WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    try:
        tokenizer = AutoTokenizer.from_pretrained(info.path, subfolder="tokenizer")
        encoder = UMT5EncoderModel.from_pretrained(info.path, subfolder="text_encoder", torch_dtype=dtype)
    except Exception as exc:
        raise _load_failure("text_encoder", info.path, exc) from exc
    encoder.requires_grad_(False).eval().to(device)
    return WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, scheduler=None)


def load_expert(info: TeacherInfo, subfolder: str, dtype: torch.dtype) -> Any:
    from diffusers import WanTransformer3DModel

    try:
        # safetensors are memory-mapped, so host RAM holds one copy of the weights at most.
        model = WanTransformer3DModel.from_pretrained(info.path, subfolder=subfolder, torch_dtype=dtype)
    except Exception as exc:
        raise _load_failure(subfolder, info.path, exc) from exc
    return model.requires_grad_(False).eval()


def load_experts(info: TeacherInfo, dtype: torch.dtype) -> tuple[Any, Any | None]:
    """(transformer, transformer_2) of the teacher, frozen on the CPU: the high- and low-noise
    experts of an A14B model, or its one transformer and None (TI2V-5B); the user's LoRAs
    (`info.loras`) fused in here, before any placement, so every placement holds fused weights."""
    experts = [load_expert(info, folder, dtype) for folder in info.expert_folders]
    for folder, model in zip(info.expert_folders, experts, strict=True):
        fuse_teacher_loras(model, folder, info.loras, info.kind.model)
    return experts[0], (experts[1] if len(experts) == 2 else None)


def with_teacher_loras(info: TeacherInfo, specs: list[str] | tuple[str, ...] | None) -> TeacherInfo:
    """`info` with the LoRAs of --teacher_lora, each file read and checked against an empty model of
    its expert: a missing file, a bad scale, half a pair or a LoRA of another model is refused here,
    before a cache or an output is written."""
    return with_loras(info, parse_teacher_loras(list(specs), info.kind.experts)) if specs else info


def with_loras(info: TeacherInfo, loras: tuple[TeacherLora, ...]) -> TeacherInfo:
    """`info` with `loras` (parsed, or as a run recorded them), each checked against its expert and
    against the model an export of ours records (teacher_lora.check_recorded_kinds)."""
    check_recorded_kinds(loras, info.kind, info.path)
    configs = {
        folder: _read_json(info.path / folder / "config.json", info.path) for folder in info.expert_folders
    }
    check_loras_fit(loras, configs, info.kind.model)
    return replace(info, loras=loras)


def shard_expert(model: Any, device: torch.device, world_size: int) -> Any:
    """Shard a frozen expert with FSDP2: each rank keeps 1/N of every block, N the ranks of its node.

    One node: sharded over all its ranks. Several nodes: sharded within each node and replicated
    across nodes (HSDP on the 2-D mesh of distill/ops/mesh.py), so gathers never leave a node.
    One `fully_shard` per transformer block, then the root, so a forward gathers one block at a
    time and frees it after use. No gradients and no optimizer: only the frozen weights are sharded.
    LoRA adapters inside the expert (a LoRA student's or critic's) stay whole on every rank, outside
    FSDP: they are small, and DDP reduces their gradients as it does any trained model's.
    Every rank must then call the expert the same number of times (see GuidedTeacher.lockstep).
    """
    from torch.distributed.fsdp import fully_shard

    from distill.ops.mesh import shard_mesh

    mesh = shard_mesh(device, world_size)
    adapters = {p for name, p in model.named_parameters() if ".lora_" in name}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=adapters)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=adapters)
    return model


def place_expert(model: Any, device: torch.device, on_cpu: bool, shard_over: int = 0) -> Any:
    """Put a frozen expert where it computes: on the device, streamed from CPU RAM block by block,
    or sharded over `shard_over` ranks."""
    if shard_over > 1:
        return shard_expert(model.to(device), device, shard_over)
    if on_cpu and device.type == "cuda":
        # Weights stay in (pinned) CPU memory; each block is copied to the GPU just before it runs,
        # overlapped with compute on a side stream. The forward still runs on the GPU.
        model.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
            # Copies from pinned memory overlap the previous block's compute instead of blocking the
            # host; record_stream lets the allocator reuse each block's memory as soon as it is done.
            non_blocking=True,
            record_stream=True,
        )
        return model
    return model.to(device)


def empty_device_cache() -> None:
    """Give a finished stage's blocks back to the device once the caller has dropped its last
    references (`del`): the text encoder, its pipeline and the VAE hold no reference cycle, so they
    are freed there (tests/test_stage_memory.py). On CUDA a collection runs first, lest a cycle
    elsewhere hold device memory the next stage needs; on the CPU it would cost 0.25 s a call."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
