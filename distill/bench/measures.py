"""What the benchmark reports beside the step times: memory, FLOPs and MFU, the environment, the
models' sizes, and a streamed (CPU-held) teacher's forward against a GPU-resident one."""

from __future__ import annotations

import gc
import math
import platform
import resource
from collections.abc import Callable, Iterator
from typing import Any

import torch

from distill.bench.settings import BOUNDARY_RATIO, FLOW_SHIFT, GUIDANCE_HIGH, GUIDANCE_LOW
from distill.bench.setup import Setup, random_expert
from distill.bench.timing import summary_ms, time_block
from distill.models.flow_matching import (
    sample_sigmas,
    sigmas_to_timesteps,
)
from distill.models.guided_teacher import GuidedTeacher

# Dense bf16 tensor-core peak (no sparsity), matched against torch.cuda.get_device_name.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("4090", 165.0),
)


def compare_teacher_placement(setup: Setup, reps: int, sync: Callable[[], None]) -> dict[str, Any]:
    """Streamed (CPU-resident) teacher against a GPU-resident one of the same shape, same inputs."""
    s = setup.settings
    config = dict(setup.teacher_config)
    resident = [random_expert(config, setup.device, setup.teacher_dtype) for _ in range(2)]
    streamed = setup.loop.teacher
    gpu = GuidedTeacher(
        *resident, BOUNDARY_RATIO, GUIDANCE_HIGH, GUIDANCE_LOW, setup.device, setup.teacher_dtype
    )
    generator = torch.Generator().manual_seed(s.seed + 11)
    x_t = torch.randn((s.batch_size, *setup.latent_shape), generator=generator).to(setup.device)
    cond = torch.randn(s.batch_size, s.text_len, config["text_dim"], generator=generator)
    cond = cond.to(setup.device, setup.teacher_dtype)
    times: dict[str, list[float]] = {"streamed": [], "resident": []}
    for i in range(reps + 1):
        t = sigmas_to_timesteps(sample_sigmas(s.batch_size, FLOW_SHIFT, generator))
        for name, teacher in (("streamed", streamed), ("resident", gpu)):
            seconds = time_block(
                lambda teacher=teacher, t=t: teacher.velocity(x_t, t, cond, setup.loop.negative), 1, sync
            )
            if i:  # the first round warms both up
                times[name].append(seconds)
    del gpu, resident
    free_memory()
    streamed_ms, resident_ms = summary_ms(times["streamed"]), summary_ms(times["resident"])
    return {
        "streamed_ms": streamed_ms,
        "resident_ms": resident_ms,
        "slowdown": streamed_ms["median"] / resident_ms["median"],
    }


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(setup: Setup) -> dict[str, Any]:
    student = setup.student
    trainable = [p for p in student.parameters() if p.requires_grad]
    state = [v for s in setup.loop.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    teacher = tensor_bytes(t for m in (setup.high, setup.low) for t in (*m.parameters(), *m.buffers()))
    streamed = setup.settings.teacher_on_cpu and setup.device.type == "cuda"
    floor = {
        "student_params": tensor_bytes(student.parameters()),
        "student_grads": tensor_bytes(iter(trainable)),
        "optimizer_state": tensor_bytes(iter(state)),
        "teacher_weights": teacher,
        "teacher_placement": "cpu" if streamed or setup.device.type == "cpu" else str(setup.device),
    }
    for name, model in setup.extra.items():  # dmd: the critic, with its gradients and AdamW state
        optimizer = setup.loop.optimizers[name]
        floor[f"{name}_params"] = tensor_bytes(model.parameters())
        floor[f"{name}_grads"] = tensor_bytes(p for p in model.parameters() if p.requires_grad)
        floor[f"{name}_optimizer_state"] = tensor_bytes(
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
    report: dict[str, Any] = {
        "floor": floor,
        "floor_bytes": sum(v for k, v in floor.items() if k != "teacher_placement")
        - (teacher if streamed else 0),
        "teacher_host_bytes": teacher if streamed else 0,
        "cpu_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cuda_max_allocated_bytes": None,
        "cuda_max_reserved_bytes": None,
    }
    if setup.device.type == "cuda":
        report["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(setup.device)
        report["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(setup.device)
    return report


def forward_flops(config: dict[str, Any], tokens: int, text_len: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one WanTransformer3DModel forward on one sample.

    Patch embedding, timestep and text embedders, per block self-attention (q, k, v, o and the
    two attention products), cross-attention (q, o on the video tokens, k, v on the text tokens,
    the two products), the feed-forward network, and the output projection.
    """
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    patch = math.prod(config["patch_size"])
    n, length = tokens, text_len
    embed = (
        2 * n * config["in_channels"] * patch * dim
        + 2 * (config["freq_dim"] * dim + dim * dim + dim * 6 * dim)
        + 2 * length * (config["text_dim"] * dim + dim * dim)
    )
    self_attention = 2 * n * 4 * dim * dim + 4 * n * n * dim
    cross_attention = 2 * n * 2 * dim * dim + 2 * length * 2 * dim * dim + 4 * n * length * dim
    ffn = 2 * n * 2 * dim * config["ffn_dim"]
    out = 2 * n * dim * config["out_channels"] * patch
    return embed + config["num_layers"] * (self_attention + cross_attention + ffn) + out


def flops_report(setup: Setup, step_seconds: float) -> dict[str, Any]:
    s = setup.settings
    tokens = setup.tokens_per_sample
    # Each sample meets one expert, twice (cond + uncond); the experts share one shape.
    teacher = 2 * s.batch_size * forward_flops(setup.teacher_config, tokens, s.text_len)
    student_forward = s.batch_size * forward_flops(setup.student_config, tokens, s.text_len)
    student = 3 * student_forward
    if s.method == "dmd":
        # A cycle: the generator update (rollout to step k, forward + backward, the critic's fake
        # score) and critic_updates critic updates (rollout to k, one more forward, the critic's
        # forward + backward); k is uniform over the K steps, so a rollout averages (K-1)/2 forwards.
        rollout = (s.student_steps - 1) / 2 * student_forward
        critic = student_forward  # the critic has the student's shape
        student = int(
            rollout
            + 3 * student_forward
            + critic
            + s.critic_updates * (rollout + student_forward + 3 * critic)
        )
    per_step = teacher + student
    achieved = per_step / step_seconds
    peak = peak_flops(setup.device, s.peak_tflops)
    return {
        "per_step": per_step,
        "teacher_per_step": teacher,
        "student_per_step": student,
        "achieved_per_s": achieved,
        "peak_per_s": peak,
        "mfu": achieved / peak if peak else None,
    }


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def environment(device: torch.device) -> dict[str, Any]:
    import diffusers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
    }


def model_summary(setup: Setup) -> dict[str, Any]:
    def shape(config: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
        return {
            "layers": config["num_layers"],
            "heads": config["num_attention_heads"],
            "head_dim": config["attention_head_dim"],
            "ffn_dim": config["ffn_dim"],
            "text_dim": config["text_dim"],
            "params": sum(p.numel() for p in model.parameters()),
        }

    return {
        "teacher_expert": shape(setup.teacher_config, setup.high),
        "student": shape(setup.student_config, setup.student),
        "latent_shape": list(setup.latent_shape),
        "tokens_per_sample": setup.tokens_per_sample,
        "text_len": setup.settings.text_len,
    }
