"""One model's step alone, at the shapes users train: the A14B LoRA step (a whole teacher-shaped expert,
frozen in the teacher dtype, with float32 rank-R adapters on the trainer's default targets: forward,
loss, backward, AdamW) and the teacher's guided forward (one expert on cond + uncond, no gradient).

No trainer runs around it: these presets say what the GPU does with the model (step time, FLOPs, MFU,
peak memory), which the distillation presets' trainer-against-bare comparison then builds on. FLOPs are
counted as the run plan counts them (distill/train/flops.py: attention's products included, its
backward 2.5 x its forward as fused kernels recompute the scores), without the checkpointed blocks'
second forward, which MFU does not credit (`per_step_with_recompute` has it).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from distill.bench.bare import synchronizer
from distill.bench.measures import environment, peak_flops, tensor_bytes
from distill.bench.settings import BenchSettings
from distill.bench.setup import latent_shape, random_expert, tokens_per_sample
from distill.bench.table import human_bytes, human_count
from distill.bench.timing import summary_ms, time_block
from distill.config.settings import LORA_TARGETS
from distill.models.attention_backend import apply_backend, sdpa_choice
from distill.train.flops import model_flops


def expert_config(settings: BenchSettings) -> dict[str, Any]:
    if not isinstance(settings.teacher, dict):
        raise SystemExit(f"preset {settings.preset}: the {settings.workload} bench needs the expert's shape")
    config = dict(settings.teacher)
    if settings.teacher_layers:
        config["num_layers"] = settings.teacher_layers
    return config


def build_step(
    settings: BenchSettings, config: dict[str, Any], device: torch.device
) -> tuple[torch.nn.Module, Callable[[], None], list[torch.nn.Parameter], torch.optim.Optimizer | None]:
    """The model, one step of it, its trained parameters and their optimizer (None for the teacher)."""
    dtype = getattr(torch, settings.dtype)
    model = random_expert(config, device, dtype)
    params: list[torch.nn.Parameter] = []
    optimizer = None
    if settings.workload == "lora":
        from distill.models.lora import LoraShape, add_adapter

        shape = LoraShape(settings.lora_rank, float(settings.lora_rank), LORA_TARGETS)
        params = add_adapter(model, "student", shape, seed=settings.seed)
        if settings.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    apply_backend(settings.attention_backend, model)
    if settings.compile:
        model.compile_repeated_blocks()
    generator = torch.Generator().manual_seed(settings.seed)
    batch = settings.batch_size * (1 if settings.workload == "lora" else 2)  # the teacher: cond + uncond
    shape = latent_shape(settings.height, settings.width, settings.num_frames)
    inputs = {
        "hidden_states": torch.randn((batch, *shape), generator=generator).to(device, dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=generator).to(device),
        "encoder_hidden_states": torch.randn(
            batch, settings.text_len, config["text_dim"], generator=generator
        ).to(device, dtype),
    }
    target = torch.randn((batch, *shape), generator=generator).to(device)

    def lora_step() -> None:
        assert optimizer is not None
        prediction = model(**inputs, return_dict=False)[0]
        (prediction.float() - target).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def teacher_step() -> None:
        with torch.no_grad():
            model(**inputs, return_dict=False)

    return model, lora_step if optimizer is not None else teacher_step, params, optimizer


def run_model_step(settings: BenchSettings) -> dict[str, Any]:
    """Build the model, warm up, time `steps` steps in blocks of `block`, and report."""
    started = time.perf_counter()
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {settings.preset} needs CUDA, and torch sees no GPU")
    torch.manual_seed(settings.seed)
    config = expert_config(settings)
    model, step, params, optimizer = build_step(settings, config, device)
    sync = synchronizer(device)
    for _ in range(settings.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    blocks = max(1, -(-settings.steps // settings.block))
    times = [time_block(step, settings.block, sync) for _ in range(blocks)]
    ms = summary_ms(times)
    shape = latent_shape(settings.height, settings.width, settings.num_frames)
    tokens = tokens_per_sample(config, shape)
    flops = step_flops(settings, config, shape)
    peak = peak_flops(device, settings.peak_tflops)
    achieved = flops["per_step"] / (ms["median"] / 1e3)
    state = [
        v for s in (optimizer.state.values() if optimizer else ()) for v in s.values() if torch.is_tensor(v)
    ]
    env = environment(device)
    dtype = getattr(torch, settings.dtype)
    if device.type == "cuda" and settings.attention_backend in (None, "native"):
        env["sdpa_kernel"] = sdpa_choice(
            config["num_attention_heads"], tokens, config["attention_head_dim"], dtype, device
        )
    return {
        "preset": settings.preset,
        "workload": settings.workload,
        "settings": {k: v for k, v in vars(settings).items()},
        "environment": env,
        "models": {
            "model": {
                "layers": config["num_layers"],
                "heads": config["num_attention_heads"],
                "head_dim": config["attention_head_dim"],
                "params": sum(p.numel() for p in model.parameters()),
                "trained_params": sum(p.numel() for p in params),
            },
            "latent_shape": list(shape),
            "tokens_per_sample": tokens,
            "text_len": settings.text_len,
        },
        "steps": {"warmup": settings.warmup, "block": settings.block, "timed": blocks * settings.block},
        "step": {
            "median_ms": ms["median"],
            "p10_ms": ms["p10"],
            "p90_ms": ms["p90"],
            "samples_per_s": settings.batch_size * 1e3 / ms["median"],
        },
        "flops": {
            **flops,
            "achieved_per_s": achieved,
            "peak_per_s": peak,
            "mfu": achieved / peak if peak else None,
        },
        "memory": {
            "weights_bytes": tensor_bytes(t for t in (*model.parameters(), *model.buffers())),
            "optimizer_state_bytes": tensor_bytes(iter(state)),
            "cpu_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device)
            if device.type == "cuda"
            else None,
        },
        "wall_s": time.perf_counter() - started,
    }


def step_flops(
    settings: BenchSettings, config: dict[str, Any], shape: tuple[int, int, int, int]
) -> dict[str, float]:
    """FLOPs of one bench step: the LoRA step's forward and backward (the recomputed forward apart),
    or the teacher's two forwards (cond + uncond) a sample."""
    if settings.workload == "lora":
        flops = model_flops(config, shape, settings.text_len, "lora", settings.lora_rank, LORA_TARGETS)
        per_sample = flops.forward + flops.backward
        with_recompute = flops.trained_step(settings.gradient_checkpointing)
    else:
        flops = model_flops(config, shape, settings.text_len)
        per_sample = with_recompute = 2 * flops.forward
    attention = sum(p.flops for p in flops.products if p.attention)
    return {
        "per_step": settings.batch_size * per_sample,
        "per_step_with_recompute": settings.batch_size * with_recompute,
        "attention_share_of_forward": attention / flops.forward,
    }


def format_model_step(result: dict[str, Any]) -> str:
    """The result as a few lines for the terminal."""
    s, env, model = result["settings"], result["environment"], result["models"]["model"]
    step, flops, memory = result["step"], result["flops"], result["memory"]
    what = {"lora": f"LoRA rank {s['lora_rank']} step", "teacher": "teacher guided forward (cond + uncond)"}
    lines = [
        f"distill.bench  preset {result['preset']}  {env['device_name']} ({env['device']})",
        f"  {what[result['workload']]}: {model['layers']} layers x {model['heads']} heads x {model['head_dim']}, "
        f"{human_count(model['params'])} params ({human_count(model['trained_params'])} trained), "
        f"{result['models']['tokens_per_sample']} tokens a sample, batch {s['batch_size']}",
        f"  attention backend: {s['attention_backend'] or 'SDPA picks'}"
        + (f" (SDPA runs {env['sdpa_kernel']})" if env.get("sdpa_kernel") else ""),
        f"  step: median {step['median_ms']:.1f} ms (p10 {step['p10_ms']:.1f}, p90 {step['p90_ms']:.1f})",
        f"  FLOPs a step: {human_count(flops['per_step'])} (attention {100 * flops['attention_share_of_forward']:.0f}%"
        f" of a forward); achieved {human_count(flops['achieved_per_s'])}/s"
        + (f", MFU {100 * flops['mfu']:.1f}%" if flops["mfu"] is not None else ""),
        f"  memory: weights {human_bytes(memory['weights_bytes'])}, optimizer state "
        f"{human_bytes(memory['optimizer_state_bytes'])}, peak CUDA {human_bytes(memory['cuda_max_allocated_bytes'])}, "
        f"peak RSS {human_bytes(memory['cpu_rss_peak_bytes'])}",
    ]
    return "\n".join(lines)
