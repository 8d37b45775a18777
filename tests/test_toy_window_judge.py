"""The toy teacher's answer on windows of the world's own streams (distill/toy/window_judge.py): right
on the window that starts the stream, rewritten past it, for shapes standing still too. docs/streaming.md
rests on this to say why a longer training rollout (--rollout_frames) cannot be proven on the toy world."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill.toy.window_judge import judge


@pytest.mark.parametrize("still", [False, True], ids=["every_motion", "standing_still"])
def test_the_toy_teacher_keeps_a_streams_first_window_and_rewrites_the_later_ones(
    toy_teacher: Path, still: bool
) -> None:
    rows = judge(str(toy_teacher), count=6, frames=0, still=still)
    low = {row["start"]: row for row in rows if row["sigma"] == 0.3}
    assert max(low[0]["error"]) < 0.1, low[0]
    for start in (2, 4, 6):
        # Past the stream's start the teacher moves every frame of the window, its first the most.
        assert min(low[start]["error"]) > 3 * max(low[0]["error"]), low[start]
        assert low[start]["error"][0] == max(low[start]["error"]), low[start]
    # ...and puts a clip start's change from frame to frame in, whatever the window holds: at noise 0.6
    # its estimate's first change stays near the stream's first, far above the window's own.
    mid = {row["start"]: row for row in rows if row["sigma"] == 0.6}
    for start in (4, 6):
        assert mid[start]["teacher_change"][0] > 2 * mid[start]["change"][0], mid[start]
    if still:  # the pixels hold still, yet the latents change less and less: the encoder warming up
        assert low[6]["change"][1] < 0.1 * low[0]["change"][0], (low[0], low[6])


def test_the_teachers_own_stream_goes_on_a_window_at_a_time(toy_teacher: Path, capsys) -> None:
    """`stream_by_windows` (the teacher itself streamed, docs/streaming.md) only adds frames: a longer
    stream begins with the shorter one, bit for bit, and every added frame was made; the command
    scores such streams through the stream reader."""
    import torch

    from distill.toy.evaluation import eval_prompts
    from distill.toy.window_judge import guided_teacher, main, next_window, stream_by_windows

    guided, cond, negative = guided_teacher(str(toy_teacher), eval_prompts(2, clips=True))
    short = stream_by_windows(guided, cond, negative, latent_frames=3, steps=2)
    long = stream_by_windows(guided, cond, negative, latent_frames=5, steps=2)
    assert long.shape == (2, 16, 5, 4, 4) and torch.equal(long[:, :, :3], short)
    assert all(long[:, :, frame].abs().sum() > 0 for frame in range(5))
    # A window made on a past sees it: another past, the same noise, another new frame.
    sigmas = torch.linspace(1.0, 0.0, 3)
    noise = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    made = [
        next_window(guided, cond, negative, past, noise, sigmas)
        for past in (long[:, :, 1:3], -long[:, :, 1:3])
    ]
    assert (made[0][:, :, 2] - made[1][:, :, 2]).abs().mean() > 0.05
    assert main(["--teacher", str(toy_teacher), "--prompts", "2", "--stream_steps", "1"]) == 0
    assert "the teacher streamed a window at a time, 2 prompts: {'accuracy': " in capsys.readouterr().out
