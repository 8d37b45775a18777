"""`--attention_backend NAME`: which attention kernel the Wan transformers run, through diffusers'
attention dispatcher (`ModelMixin.set_attention_backend`, diffusers/models/attention_dispatch.py).

Left out (the default) nothing is set and diffusers' `native` backend calls
`torch.nn.functional.scaled_dot_product_attention`, which picks its own kernel; on CUDA the trainer
logs the one it picks (`sdpa_choice`). Which names are refused where they cannot train, and why,
is distill.config.attention_backends' (checked with the run's other settings).

The backend changes how attention is computed, not what: a student trained under one samples the
same under another up to kernel rounding, so it is not part of the run's identity or model card.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from distill.config.attention_backends import FLAG
from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo

logger = logging.getLogger(__name__)


def apply_backend(name: str | None, *models: torch.nn.Module | None) -> None:
    """Set `name` on every diffusers model inside `models` (a student, an expert, a LoRA model's
    experts, a critic's copies; None skipped); None leaves them as they are, so SDPA picks its kernel."""
    if name is None:
        return
    from diffusers import ModelMixin

    with process_default_kept():
        for model in filter(None, models):
            for module in model.modules():
                if isinstance(module, ModelMixin):
                    module.set_attention_backend(name)


@contextlib.contextmanager
def process_default_kept() -> Iterator[None]:
    """diffusers' `set_attention_backend` also makes its backend the process-wide default, which every
    model without one of its own then runs (another model, a later run in the same process): put the
    default back, so a backend reaches only the models it was set on."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry._active_backend
    try:
        yield
    finally:
        _AttentionBackendRegistry.set_active_backend(default)


def has_backend(model: torch.nn.Module) -> bool:
    """Whether a backend was set on any attention of `model` (context parallel then keeps it)."""
    return any(getattr(getattr(m, "processor", None), "_attention_backend", None) for m in model.modules())


def sdpa_choice(heads: int, tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel torch's SDPA picks for these shapes on `device`: flash, efficient, cudnn or math.

    Asks torch's own dispatcher (`torch._fused_sdp_choice`, the call SDPA makes itself) on empty
    tensors of one sample's shape: nothing runs, and the choice is the one training's calls get."""
    from torch.nn.attention import SDPBackend

    q = torch.empty((1, heads, tokens, head_dim), dtype=dtype, device=device)
    choice = int(torch._fused_sdp_choice(q, q, q))
    del q
    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    return {
        "FLASH_ATTENTION": "flash",
        "EFFICIENT_ATTENTION": "efficient",
        "CUDNN_ATTENTION": "cudnn",
        "MATH": "math",
    }.get(names.get(choice, ""), names.get(choice, str(choice)).lower())


def log_sdpa_choice(
    what: str, config: dict, tokens: int, dtype: torch.dtype, device: torch.device, backend: str | None
) -> str | None:
    """On CUDA with SDPA left to choose (no backend, or `native`), log once which kernel it runs for
    `what` (a model of `config`) and return its name; elsewhere None: a CPU run is left as it was."""
    if device.type != "cuda" or backend not in (None, "native"):
        return None
    kernel = sdpa_choice(
        int(config["num_attention_heads"]), tokens, int(config["attention_head_dim"]), dtype, device
    )
    logger.info(
        "attention of the %s: SDPA runs its %s kernel (%d heads x %d, %s, %s); %s picks another",
        what,
        kernel,
        config["num_attention_heads"],
        config["attention_head_dim"],
        str(dtype).removeprefix("torch."),
        torch.cuda.get_device_name(device),
        FLAG,
    )
    return kernel


def log_run_kernels(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict,
    teacher_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """On CUDA, which kernel SDPA runs for a run's student and for its teacher (their dtypes differ:
    an autocast student and a bf16 teacher, or a float32 student that gets no fused kernel)."""
    tokens = info.tokens(cfg.height, cfg.width, cfg.num_frames)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision)
    student_dtype = teacher_dtype if cfg.student_lora_rank else autocast or torch.float32
    for what, config, dtype in (
        ("student", student_config, student_dtype),
        ("teacher", info.expert_config, teacher_dtype),
    ):
        log_sdpa_choice(what, config, tokens, dtype, device, cfg.attention_backend)
