"""The objective's tensor functions against hand-computed values."""

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

from distill.models.flow_matching import (
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


def test_timesteps_are_those_wan_pipelines_scheduler_feeds_the_models(tiny_teacher):
    """Training asks the teacher (and the student) at floor(1000 * sigma) as int64, the value
    WanPipeline's UniPC scheduler passes at the same sigma; x_t uses the sigma's float32 rounding."""
    config = UniPCMultistepScheduler.load_config(tiny_teacher / "scheduler")
    float32_floor_differs = 0
    for shift in (1.0, 3.0, 5.0):
        scheduler = UniPCMultistepScheduler.from_config(config, flow_shift=shift)
        for steps in range(1, 61):
            scheduler.set_timesteps(steps)
            # The scheduler's float64 sigmas: Wan's shift of an even grid, the first kept off 1.0.
            sigmas = shift_sigmas(torch.from_numpy(np.linspace(1, 1 / 1000, steps + 1)[:-1]), shift)
            sigmas[0] -= 1e-6
            assert torch.equal(sigmas.float(), scheduler.sigmas[:-1])  # the same sigmas
            timesteps = sigmas_to_timesteps(sigmas)
            assert timesteps.dtype == torch.int64 and torch.equal(timesteps, scheduler.timesteps), (
                shift,
                steps,
            )
            float32_floor_differs += int((torch.floor(sigmas.float() * 1000).long() != timesteps).sum())
    assert float32_floor_differs > 0  # why the trainer keeps its sigmas in float64 until x_t
    assert sample_sigmas(3, 3.0, torch.Generator().manual_seed(0)).dtype == torch.float64


def test_noise_is_seeded_per_global_sample_so_ranks_draw_only_their_rows():
    from distill.train.methods.base import BatchRandomness

    def draws(rank: int, world: int, batch: int, count: int = 3) -> list[torch.Tensor]:
        rng = BatchRandomness(torch.Generator().manual_seed(0), 7, rank, world, torch.device("cpu"))
        return [rng.noise((batch, 2, 1, 3, 3)) for _ in range(count)]

    one_process = draws(0, 1, 4)
    two_ranks = [draws(rank, 2, 2) for rank in (0, 1)]
    for n, whole in enumerate(one_process):
        # Rank r keeps rows [2r, 2r + 2) of the same global batch: equal to the bit, not just close.
        assert torch.equal(torch.cat([two_ranks[0][n], two_ranks[1][n]]), whole)
    assert not torch.equal(one_process[0], one_process[1]), "every draw is new noise"
    assert not torch.equal(one_process[0][0], one_process[0][1]), "every row is its own sample"
    # A resumed run needs only the draw count to continue the same stream.
    resumed = BatchRandomness(torch.Generator().manual_seed(0), 7, 0, 1, torch.device("cpu"))
    resumed.noise_draws = 2
    assert torch.equal(resumed.noise((4, 2, 1, 3, 3)), one_process[2])
    other_seed = BatchRandomness(torch.Generator().manual_seed(0), 8, 0, 1, torch.device("cpu"))
    assert not torch.equal(other_seed.noise((4, 2, 1, 3, 3)), one_process[0])


def test_a_runs_noise_is_the_same_whatever_its_device():
    """Drawn on the CPU, then moved: a GPU run draws the numbers a CPU run of the same seed draws, so
    it can be replayed on a CPU. (The meta device stands in for a GPU here: no device generator is
    made for it, which a CUDA generator's other numbers would need.)"""
    from distill.train.methods.base import BatchRandomness

    shape = (2, 16, 1, 4, 4)
    draws = {}
    for device in ("cpu", "meta"):
        rng = BatchRandomness(torch.Generator().manual_seed(0), 7, 0, 1, torch.device(device))
        draws[device] = rng.noise_on_cpu(shape)
        moved = rng.noise(shape)
        assert moved.device.type == device and moved.shape == shape
    assert torch.equal(draws["cpu"], draws["meta"])
    replay = BatchRandomness(torch.Generator().manual_seed(0), 7, 0, 1, torch.device("cpu"))
    assert torch.equal(replay.noise(shape), draws["cpu"])  # what the CPU run trains on
