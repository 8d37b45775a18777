"""The objective's tensor functions against hand-computed values."""

import torch

from distill.objective import (
    add_noise,
    apply_guidance,
    high_noise_mask,
    per_sample_mse,
    sample_sigmas,
    shift_sigmas,
    sigmas_to_timesteps,
)


def test_shift_matches_wan_formula_and_keeps_endpoints():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    shifted = shift_sigmas(s, 3.0)
    assert torch.allclose(shifted, torch.tensor([0.0, 0.75 / 1.5, 1.5 / 2.0, 1.0]))
    assert torch.equal(shift_sigmas(s, 1.0), s)


def test_sampled_sigmas_are_in_range_reproducible_and_favour_high_noise():
    a = sample_sigmas(10_000, 3.0, torch.Generator().manual_seed(0))
    b = sample_sigmas(10_000, 3.0, torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    assert a.min() > 0 and a.max() < 1
    # With shift 3, P(sigma >= 0.875) = P(u >= 0.875/(3-2*0.875)) = 1 - 0.7 = 0.3.
    assert abs((a >= 0.875).float().mean().item() - 0.3) < 0.02


def test_add_noise_interpolates_per_sample():
    x0 = torch.ones(2, 3, 1, 2, 2)
    noise = torch.full_like(x0, 5.0)
    x_t = add_noise(x0, noise, torch.tensor([0.0, 0.5]))
    assert torch.allclose(x_t[0], x0[0])
    assert torch.allclose(x_t[1], torch.full_like(x0[1], 3.0))


def test_routing_boundary_is_inclusive_like_wan_pipeline():
    t = sigmas_to_timesteps(torch.tensor([0.874, 0.875, 0.9, 0.1]))
    assert high_noise_mask(t, 0.875).tolist() == [False, True, True, False]


def test_guidance_and_mse():
    cond, uncond = torch.tensor([2.0]), torch.tensor([1.0])
    assert apply_guidance(cond, uncond, 4.0).item() == 5.0
    pred = torch.zeros(2, 4)
    target = torch.tensor([[1.0, 1, 1, 1], [2, 2, 2, 2]])
    assert per_sample_mse(pred, target).tolist() == [1.0, 4.0]
