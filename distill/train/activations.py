"""What one model's forward (and backward) holds in memory, measured on the real diffusers model.

The memory plan needs, at the run's real sizes (a 14B expert at 32,760 tokens), the bytes a forward
without gradient needs on top of the weights (`no_grad_peak`), what a forward with gradient leaves
saved for backward and the peak of forward + loss + backward (`trained`). Running that for real would need the GPU being planned for,
so the real `WanTransformer3DModel` (with the run's LoRA adapters, dtypes, autocast and gradient
checkpointing) runs on fake tensors (torch's FakeTensorMode: real shapes and dtypes, no storage) while
`LiveTensorMemory` follows every storage the ops allocate and free, backward included.

Exact, not estimated: every block of a model is the same, so each quantity is an affine function of the
depth; it is measured at 2 and 3 blocks and extended to the model's depth (checked against a full-depth
measurement in tests/test_memory_plan.py). Fake tensors use CPU kernels' choices wherever the
plan is made: attention is the fused SDPA kernel that saves its output and log-sum-exp (as the fused
CUDA kernels do), never the N x N score matrix of the math path.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from distill.ops.live_memory import LiveTensorMemory
from distill.train.measurement_cache import cached_measurement

PROBE_DEPTHS = (2, 3)  # blocks of the two measured models (1 block has a one-off difference)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelUse:
    """One model as a step uses it: its config, its input, and how it computes."""

    config: str  # the WanTransformer3DModel config as sorted JSON (hashable)
    latent_shape: tuple[int, int, int, int]  # (C, F, H, W) of one sample
    text_len: int  # rows of the prompt embedding (--max_sequence_length)
    batch: int
    weights: str = "float32"  # the dtype the weights are held in (16-bit: diffusers' fp32 modules stay fp32)
    autocast: str | None = None  # autocast dtype of the forward, None without
    checkpointing: bool = False
    lora_rank: int = 0  # > 0: adapters of this rank are trained, the base weights frozen
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    grads_held: bool = False  # gradients exist before the backward (accumulation): summed into
    # A timestep per token (TI2V-5B's expand_timesteps): the model then holds a per-token time
    # embedding and, in every block, a per-token float32 modulation (6 x width per token) where a
    # per-sample timestep has one row; at 27,280 tokens x 3,072 that is 2 GB per block's forward.
    token_timesteps: bool = False

    @staticmethod
    def of(config: dict[str, Any], **fields: Any) -> ModelUse:
        return ModelUse(json.dumps(config, sort_keys=True, default=list), **fields)

    def with_depth(self, layers: int) -> dict[str, Any]:
        return {**json.loads(self.config), "num_layers": layers}

    @property
    def layers(self) -> int:
        return int(json.loads(self.config)["num_layers"])


@dataclass(frozen=True)
class Trained:
    """Bytes above the model's weights (and above gradients already held) of a forward + backward."""

    held: float  # after the forward: the saved activations and the output
    peak: float  # the peak of forward + loss + backward (new gradients included)


def stored_bytes(config: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of a model's parameters as diffusers loads it in `dtype` (its float32 modules stay float32)."""
    return _stored_bytes(json.dumps(config, sort_keys=True, default=list), str(dtype).removeprefix("torch."))


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of the model `config` describes (counted on the meta device, once per config)."""
    return _parameter_count(json.dumps(config, sort_keys=True, default=list))


@lru_cache(maxsize=64)
def _stored_bytes(config: str, dtype: str) -> int:
    from accelerate import init_empty_weights

    from distill.models.student import build_student

    with init_empty_weights(include_buffers=False):
        model = build_student(json.loads(config))
    # Modules diffusers keeps in float32 when it loads a Wan transformer in 16 bits, matched against
    # the dotted parameter name's parts as its loader does.
    keep = tuple(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    bits = torch.finfo(DTYPES[dtype]).bits
    return sum(
        p.numel() * (4 if bits == 32 or any(m in name.split(".") for m in keep) else bits // 8)
        for name, p in model.named_parameters()
    )


@lru_cache(maxsize=64)
def _parameter_count(config: str) -> int:
    from distill.models.student import count_parameters

    return count_parameters(json.loads(config))


def no_grad_peak(use: ModelUse) -> float:
    """The peak above the weights of a forward without gradient (output included), measured at
    PROBE_DEPTHS blocks on fake tensors and extended to the model's depth."""
    use = ModelUse(**{**use.__dict__, "checkpointing": False, "grads_held": False})  # no effect here
    shallow, deep = (_measure(use, depth, False)[0] for depth in PROBE_DEPTHS)
    return _extend(shallow, deep, use.layers)


def trained(use: ModelUse) -> Trained:
    """A forward + loss + backward of `use` (see Trained), measured like no_grad_peak."""
    shallow, deep = (_measure(use, depth, True) for depth in PROBE_DEPTHS)
    return Trained(*(_extend(a, b, use.layers) for a, b in zip(shallow, deep)))


def _extend(shallow: float, deep: float, layers: int) -> float:
    return max(deep + (deep - shallow) * (layers - PROBE_DEPTHS[1]), 0.0)


@lru_cache(maxsize=256)
def _measure(use: ModelUse, layers: int, with_grad: bool) -> tuple[float, ...]:
    """The bytes of one measurement: this process's, else an earlier process's under the same code
    (measurement_cache), else measured now."""
    return cached_measurement(repr((use, layers, with_grad)), lambda: _measure_now(use, layers, with_grad))


def _measure_now(use: ModelUse, layers: int, with_grad: bool) -> tuple[float, ...]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Fake tensors draw no random numbers, but building the model seeds and reads the global RNG:
    # the plan runs at the start of every run and must not shift its random streams.
    with torch.random.fork_rng(devices=[]), _quiet():
        mode = FakeTensorMode()
        model = _fake_model(use, layers, mode)
        with mode:
            return _train(model, use) if with_grad else (_no_grad_peak(model, use),)


def as_used(model: torch.nn.Module, use: ModelUse) -> torch.nn.Module:
    """`model` with the weights' dtype of `use` (as diffusers loads it: its float32 modules stay
    float32) and, for a LoRA use, its adapters added."""
    dtype = DTYPES[use.weights]
    keep = tuple(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if dtype != torch.float32 and not any(m in name.split(".") for m in keep):
            p.data = p.data.to(dtype)
    if use.lora_rank:
        from distill.models.lora import LoraShape, add_adapter

        add_adapter(model, "student", LoraShape(use.lora_rank, use.lora_alpha, use.lora_targets), seed=0)
    return model


def _fake_model(use: ModelUse, layers: int, mode: Any) -> torch.nn.Module:
    """The model of `use` at `layers` blocks with fake weights. Built on the meta device first (peft
    moves adapters with Module.to, which cannot swap fake parameters), then each weight replaced by a
    fake tensor of the same shape and dtype; buffers (rotary tables) are real and become fake copies."""
    from accelerate import init_empty_weights

    from distill.models.student import build_student

    with init_empty_weights(include_buffers=False):
        model = as_used(build_student(use.with_depth(layers)), use)
    with mode:
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    fake = torch.empty(p.shape, dtype=p.dtype)
                    module._parameters[name] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = mode.from_tensor(b)
    if use.checkpointing:
        model.enable_gradient_checkpointing()
    return model


def _inputs(model: torch.nn.Module, use: ModelUse) -> dict[str, torch.Tensor]:
    """What the methods pass: float32 latents and text (a 16-bit model gets them cast, as the teacher
    and the LoRA experts cast them), integer timesteps."""
    dtype = DTYPES[use.weights]
    config = json.loads(use.config)
    text_dim = int(config["text_dim"])
    # The model's input: the noisy latents, and for image to video the condition channels after them.
    x = torch.randn(use.batch, int(config["in_channels"]), *use.latent_shape[1:])
    text = torch.randn(use.batch, use.text_len, text_dim)
    if use.token_timesteps:  # float32, one per token, as conditioning.model_timestep builds them
        patch = config["patch_size"]
        frames, height, width = (n // p for n, p in zip(use.latent_shape[1:], patch))
        timestep = torch.full((use.batch, frames * height * width), 500.0)
    else:
        timestep = torch.full((use.batch,), 500, dtype=torch.long)
    return {
        "hidden_states": x.to(dtype),
        "timestep": timestep,
        "encoder_hidden_states": text.to(dtype),
    }


def _autocast(use: ModelUse) -> contextlib.AbstractContextManager:
    if use.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=DTYPES[use.autocast])


def _no_grad_peak(model: torch.nn.Module, use: ModelUse) -> float:
    model.eval()
    with LiveTensorMemory() as memory, torch.no_grad():
        inputs = _inputs(model, use)
        with _autocast(use):
            model(**inputs, return_dict=False)
    return float(memory.peak)


def _train(model: torch.nn.Module, use: ModelUse) -> tuple[float, float]:
    from distill.models.flow_matching import per_sample_mse

    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p) if use.grads_held else None
    with LiveTensorMemory() as memory:
        inputs = _inputs(model, use)
        with _autocast(use):
            prediction = model(**inputs, return_dict=False)[0]
        target = torch.randn(prediction.shape)
        held = memory.live
        per_sample_mse(prediction, target).mean().backward()
    return float(held), float(memory.peak)


@contextlib.contextmanager
def _quiet():
    """CPU autocast warns that layer_norm cannot use its fused kernel on mixed dtypes: expected here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        yield
