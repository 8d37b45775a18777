"""The rules of `--attention_backend NAME` (which attention kernel the Wan transformers run, through
diffusers' attention dispatcher): a name is refused, before anything heavy loads, where it cannot
train here, with the flag and a fix:

- a name diffusers 0.42.1 does not know;
- one with no backward in diffusers 0.42.1 (the FA3 package wrappers register no autograd, sage's
  and the NPU's backward raise): they sample, they do not train;
- one for other hardware (Ascend NPU, XLA) or one that needs CUDA on a CPU run;
- one whose kernel takes bfloat16/float16 only, in a run whose attention computes in float32;
- one whose package is missing (diffusers' own requirement check: flash-attn, xformers, kernels);
- one diffusers' context parallel cannot split, with --sequence_parallel above 1.

Setting the backend on the models is distill.models.attention_backend's job.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distill.ops.errors import DistillError, Stage

FLAG = "--attention_backend"

# diffusers 0.42.1 backends whose forward has a backward (torch's SDPA and flex autograd, flash-attn's
# and xformers' own autograd functions, or a backward op diffusers registers for the hub kernels).
TRAINS = (
    "native",
    "_native_cudnn",
    "_native_flash",
    "_native_efficient",
    "_native_math",
    "flex",
    "flash",
    "flash_varlen",
    "xformers",
    "flash_hub",
    "flash_varlen_hub",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
)

# Kernels that run on a CPU tensor as well as on CUDA. flex runs on a CPU only unfused, and torch
# warns that its backward is not supported that way: a CPU run is refused it.
RUNS_ON_CPU = ("native", "_native_math")

# Kernels whose inputs must be bfloat16 or float16 (diffusers' `_check_qkv_dtype_bf16_or_fp16`).
HALF_ONLY = (
    "_native_cudnn",
    "_native_flash",
    "flash",
    "flash_varlen",
    "flash_hub",
    "flash_varlen_hub",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
)

OTHER_HARDWARE = {"_native_npu": "an Ascend NPU (torch_npu)", "_native_xla": "an XLA device (torch_xla)"}

# What installs each backend's package, for the refusal's fix.
INSTALL = {
    "flash": "pip install flash-attn==2.8.3 --no-build-isolation",
    "flash_varlen": "pip install flash-attn==2.8.3 --no-build-isolation",
    "xformers": "pip install xformers",
}


def known_backends() -> list[str]:
    """Every backend name diffusers' dispatcher knows, in its own order."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [member.value for member in AttentionBackendName]


def splits_context(name: str) -> bool:
    """Whether diffusers' context parallel (--sequence_parallel) can run `name`."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(name))


def _refuse(problem: str, fixes: Iterable[str], details: str = "") -> DistillError:
    return DistillError(f"{FLAG} {problem}", details, fixes=list(fixes), stage=Stage.CONFIG)


def check_backend(
    name: str | None,
    device: torch.device | str,
    *,
    training: bool = True,
    half_precision: bool = True,
    sequence_parallel: int = 1,
) -> None:
    """Refuse `name` where it cannot run (see the module docstring); None (the default) always passes.

    `half_precision`: the attention inputs are bfloat16/float16 (bf16 weights or autocast).
    """
    if name is None:
        return
    device = torch.device(device)
    drop = f"leave {FLAG} out: SDPA then picks its kernel"
    known = known_backends()
    if name not in known:
        trains = [b for b in TRAINS if b in known]
        raise _refuse(f"{name!r} is not an attention backend", [f"use one of {', '.join(trains)}", drop])
    if name in OTHER_HARDWARE:
        raise _refuse(f"{name} needs {OTHER_HARDWARE[name]}", [f"{FLAG} native", drop])
    if training and name not in TRAINS:
        raise _refuse(
            f"{name} has no backward pass in diffusers' dispatcher: it samples, it cannot train",
            [f"{FLAG} {b}" for b in ("_native_cudnn", "_native_flash", "flash")] + [drop],
        )
    if device.type != "cuda" and name not in RUNS_ON_CPU:
        raise _refuse(
            f"{name} needs CUDA, and this run is on the {device.type}",
            [f"{FLAG} native (or _native_math) on the CPU", drop],
        )
    if name in HALF_ONLY and not half_precision:
        raise _refuse(
            f"{name} takes bfloat16/float16 attention inputs only, and this run computes attention in float32",
            [
                "--mixed_precision bf16 (student) and --teacher_dtype bfloat16",
                f"{FLAG} native, which also runs float32",
                drop,
            ],
        )
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
    )

    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except RuntimeError as error:  # its message names the package and version diffusers needs
        fix = INSTALL.get(name, "install the package the message names")
        raise _refuse(
            f"{name} cannot run: its package is missing or too old", [fix, drop], str(error)
        ) from error
    if sequence_parallel > 1 and not splits_context(name):
        both = [b for b in TRAINS if b in known and splits_context(b)]
        raise _refuse(
            f"{name} cannot be split by diffusers' context parallel (--sequence_parallel {sequence_parallel})",
            [f"{FLAG} one of {', '.join(both)}", drop, "or --sequence_parallel 1"],
        )
