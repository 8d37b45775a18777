"""The toy teacher's answer on windows of the world's own streams (distill/toy/window_judge.py): right
on the window that starts the stream, wrong past it. docs/streaming.md rests on this to say why a
longer training rollout (--rollout_frames) cannot be proven on the toy world."""

from __future__ import annotations

from pathlib import Path

from distill.toy.window_judge import judge


def test_the_toy_teacher_keeps_a_streams_first_window_and_rewrites_the_later_ones(toy_teacher: Path) -> None:
    rows = judge(str(toy_teacher), count=6, frames=0)
    low = {row["start"]: row for row in rows if row["sigma"] == 0.3}
    assert max(low[0]["error"]) < 0.1, low[0]
    for start in (2, 4, 6):
        # Past the stream's start the teacher moves every frame of the window, its first the most.
        assert min(low[start]["error"]) > 3 * max(low[0]["error"]), low[start]
        assert low[start]["error"][0] == max(low[start]["error"]), low[start]
    # ...and puts a clip start's motion in, whatever the window holds: at noise 0.6 its estimate's
    # first change stays near the stream's first (not the window's own, smaller one).
    mid = {row["start"]: row for row in rows if row["sigma"] == 0.6}
    for start in (4, 6):
        assert mid[start]["teacher_change"][0] > 2 * mid[start]["change"][0], mid[start]
