"""What decides the toy teacher's trained weights: sizes, steps and rates of the VAE fit and of
the two experts' training. Recorded in the teacher's toy_world.json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights (recorded in toy_world.json)."""

    seed: int = 0
    size: int = 32
    """Picture width and height in pixels (latents are size / 8)."""
    clip_frames: int = 9
    """Frames of the world's clips (3 latent frames); 0 = a teacher of pictures only."""
    boundary_ratio: float = 0.875
    flow_shift: float = 3.0
    vae_base_dim: int = 8
    vae_steps: int = 8000
    vae_batch: int = 12
    vae_lr: float = 5e-4
    vae_latent_noise: float = 0.05
    vae_clip_batch: int = 8
    """Clips per VAE step; every other step is a batch of clips when clip_frames > 0."""
    num_latents: int = 16384
    """Pictures encoded once for the experts' training."""
    num_clip_latents: int = 8192
    """Clips encoded once for the experts' training (when clip_frames > 0)."""
    expert_clip_batch: int = 64
    """Clips per expert step, beside expert_batch pictures."""
    expert_steps: int = 8000
    expert_batch: int = 128
    """Pictures per expert step."""
    trained_experts: tuple[str, ...] = ("high", "low")
    """Which experts train ("high", "low"); the others keep the --from teacher's weights."""
    low_focus: float = 0.0
    """Fraction of the low-noise expert's samples drawn from sigma in [FOCUS_SIGMA, its top]: where a
    clip's speed is decided (sampling from the world's own clips noised to sigma 0.67 and 0.43 came
    out 1.14x and 1.05x too fast: the low expert sets the speed there, not the high one). Measured on
5-layer experts: +0.01 on clips at most, within sampling noise; the depth was what helped."""
    expert_lr: float = 1e-3
    text_dropout: float = 0.15
    expert_overlap: float = 0.03
    """Each expert also trains this far (in sigma) past the boundary."""
    heads: int = 2
    head_dim: int = 48
    ffn_dim: int = 256
    layers: int = 3
    spatial_patch: int = 1
    """Height and width of the experts' patches: 1 = a token per latent pixel (the shipped teacher's:
    a slow clip's whole travel is under one latent pixel, and in Wan's 2 x 2 patches it hid inside
    one token); 2 = Wan's own (1, 2, 2)."""
    text_dim: int = 32
    guidance_scale: float = 4.0
    guidance_scale_2: float = 3.0
    clip_guidance_scale: float = 3.0
    clip_guidance_scale_2: float = 1.5
    """The teacher's guidance on clips. At 4 / 3 its low-noise expert's guidance speeds slow clips up
    (1.24x a slow travel, 0.85 on clips with motion counted); at 3 / 1.5 they move right (0.91).
    Pictures keep 4 / 3 (1.00 at 20 steps either way)."""
    sample_steps: int = 20
    """The teacher's full step count (UniPC)."""
