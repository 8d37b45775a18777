"""FLOPs of one forward and backward of a WanTransformer3DModel, from its config.

Counted as torch.utils.flop_counter counts them (tests/test_cost.py holds the two together on a real
model): 2 FLOPs per multiply-add of every matrix product, the linear layers and the patch embedding,
and attention's two products (N x N for self-attention, N x text for cross-attention). A backward
computes the input gradient of every layer something trained lies before and the weight gradient of
every trained layer; attention's backward recomputes the scores (2.5 x its forward, as fused kernels
do); gradient checkpointing adds the blocks' forward once more.

A model given a timestep per token (Wan2.2-TI2V-5B's `expand_timesteps`) runs its time embedder and
time projection on every token instead of once per sample: 3 products of `tokens` rows, under 1% of a 5B
forward at 704x1280x121, counted so that the plan matches FlopCounterMode on such a model too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ATTENTION_BACKWARD = 2.5  # fused attention's backward: the scores again, then four products


@dataclass(frozen=True)
class Product:
    """One matrix product of a forward: its FLOPs and what its backward computes."""

    flops: float
    weight_grad: bool = False  # its weight is trained
    input_grad: bool = False  # its input carries gradient (something trained lies before it)
    attention: bool = False  # the scores/values products of attention (no weight)
    in_block: bool = True  # recomputed by gradient checkpointing

    def backward(self) -> float:
        if self.attention:
            return ATTENTION_BACKWARD * self.flops if self.input_grad else 0.0
        return self.flops * (int(self.weight_grad) + int(self.input_grad))


@dataclass(frozen=True)
class ModelFlops:
    """The products of one model's forward for one sample."""

    products: tuple[Product, ...]

    @property
    def forward(self) -> float:
        return sum(p.flops for p in self.products)

    @property
    def backward(self) -> float:
        return sum(p.backward() for p in self.products)

    def trained_step(self, checkpointing: bool) -> float:
        """Forward + backward (+ the blocks' forward again under gradient checkpointing)."""
        recompute = sum(p.flops for p in self.products if p.in_block) if checkpointing else 0.0
        return self.forward + self.backward + recompute


def _width(config: dict[str, Any]) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def model_flops(
    config: dict[str, Any],
    latent_shape: tuple[int, int, int, int],
    text_len: int,
    trained: str = "none",
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = (),
    token_timesteps: bool = False,
) -> ModelFlops:
    """The matrix products of one forward of a WanTransformer3DModel on one sample.

    `trained`: "none" (a frozen teacher), "all" (a student or critic trained whole) or "lora" (frozen
    base, adapters of `lora_rank` on `lora_targets` trained). `token_timesteps`: the timestep is one
    per token (TI2V-5B), so the time embedder and projection run on every token.
    """
    _, frames, height, width_px = latent_shape
    # The patch embedding reads the model's whole input (image to video: the condition channels too).
    channels = int(config.get("in_channels") or latent_shape[0])
    patch = tuple(config["patch_size"])
    tokens = (frames // patch[0]) * (height // patch[1]) * (width_px // patch[2])
    width, ffn = _width(config), int(config["ffn_dim"])
    text_dim, freq_dim = int(config["text_dim"]), int(config["freq_dim"])
    out_channels = int(config.get("out_channels") or latent_shape[0])
    whole, lora = trained == "all", trained == "lora"
    carries = trained != "none"  # gradient flows back through the blocks
    products: list[Product] = []

    def linear(
        rows: int, fan_in: int, fan_out: int, grad_in: bool, name: str = "", block: bool = True
    ) -> None:
        products.append(Product(2.0 * rows * fan_in * fan_out, whole, grad_in, in_block=block))
        if lora and name in lora_targets:
            # peft: x @ A^T (rank outputs), then @ B^T; both trained.
            products.append(Product(2.0 * rows * fan_in * lora_rank, True, grad_in, in_block=block))
            products.append(Product(2.0 * rows * lora_rank * fan_out, True, True, in_block=block))

    patch_in = channels * patch[0] * patch[1] * patch[2]
    # Outside the blocks: the patch embedding, the time and text embedders, the output head. Their
    # inputs carry no gradient; a LoRA run has no adapters there, so nothing before the blocks trains.
    linear(tokens, patch_in, width, grad_in=False, block=False)
    time_rows = tokens if token_timesteps else 1
    linear(time_rows, freq_dim, width, grad_in=False, block=False)
    linear(time_rows, width, width, grad_in=whole, block=False)
    linear(time_rows, width, 6 * width, grad_in=whole, block=False)
    linear(text_len, text_dim, width, grad_in=False, block=False)
    linear(text_len, width, width, grad_in=whole, block=False)
    for index in range(int(config["num_layers"])):
        # A gradient reaches the hidden states of block 0's self-attention input only if the patch
        # embedding trains; after the first adapter (LoRA) or layer (whole) everything carries one.
        first = index == 0
        for name in ("to_q", "to_k", "to_v"):
            linear(tokens, width, width, grad_in=whole or (lora and not first), name=name)
        products.append(Product(4.0 * tokens * tokens * width, attention=True, input_grad=carries))
        linear(tokens, width, width, grad_in=carries, name="to_out.0")
        # Cross-attention: queries from the video tokens, keys and values from the projected text,
        # which carries gradient only when the text embedder trains.
        linear(tokens, width, width, grad_in=carries, name="to_q")
        for name in ("to_k", "to_v"):
            linear(text_len, width, width, grad_in=whole, name=name)
        products.append(Product(4.0 * tokens * text_len * width, attention=True, input_grad=carries))
        linear(tokens, width, width, grad_in=carries, name="to_out.0")
        linear(tokens, width, ffn, grad_in=carries, name="ffn.net.0.proj")
        linear(tokens, ffn, width, grad_in=carries, name="ffn.net.2")
    linear(tokens, width, out_channels * patch[0] * patch[1] * patch[2], grad_in=carries, block=False)
    return ModelFlops(tuple(products))
