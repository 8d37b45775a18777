"""When a causal student (--student_chunk_frames) and the methods that need one can run: refused with
the fix before anything loads.

A causal student attends block-causally over chunks of latent frames (distill/models/causal). What
cannot work with it: a clip that is not whole chunks of latent frames. (A causal LoRA student of a
teacher with two experts cannot be trained by ode_init: distill/train/run_checks.py, which knows the
teacher.)
And --method self_forcing needs a causal student, whose own rollout is its generator's input (so
neither dmd's `data` inputs nor its regression term on a first step from the teacher's noise).
"""

from __future__ import annotations

from typing import Any

from distill.ops.errors import DistillError, Stage

# The Wan VAE's temporal stride, the same for every Wan 2.2 teacher: 4k+1 frames -> k+1 latent frames.
TEMPORAL_STRIDE = 4


def latent_frames(num_frames: int) -> int:
    return (num_frames - 1) // TEMPORAL_STRIDE + 1


def frame_counts(chunk: int, near: int, count: int = 3) -> list[int]:
    """--num_frames values whose latent frames are whole chunks of `chunk`, the first `count` from `near` up."""
    latent = max(chunk, -(-latent_frames(near) // chunk) * chunk)
    return [(latent + i * chunk - 1) * TEMPORAL_STRIDE + 1 for i in range(count)]


def _refuse(title: str, why: str, fix: str) -> DistillError:
    return DistillError(title, why, fixes=[fix], stage=Stage.CONFIG)


def check_causal_settings(cfg: Any) -> None:
    """Refuse what a causal student (or the lack of one) cannot do; `cfg` is a TrainConfig."""
    chunk = cfg.student_chunk_frames
    if chunk is not None and chunk < 0:
        raise _refuse(
            f"--student_chunk_frames {chunk}: a chunk is a positive whole number of latent frames",
            "Leave it out (or give 0) for a bidirectional student.",
            "use --student_chunk_frames 3 (or 1)",
        )
    if cfg.method == "self_forcing":
        if not chunk:
            raise _refuse(
                "--method self_forcing needs a causal student",
                "Self-Forcing trains a student that makes the clip chunk after chunk on its own past; "
                "a bidirectional student has no chunks to roll out.",
                "add --student_chunk_frames 3 (latent frames per chunk; docs/streaming.md)",
            )
        if cfg.dmd_inputs != "simulate":
            raise _refuse(
                f"--dmd_inputs {cfg.dmd_inputs} cannot be combined with --method self_forcing",
                "Self-Forcing's generator input is always the student's own chunk-by-chunk rollout.",
                "drop --dmd_inputs",
            )
        if cfg.regression_weight:
            raise _refuse(
                "--regression_weight cannot be combined with --method self_forcing",
                "The regression term fits one forward of the whole clip from the teacher's noise, which a "
                "causal student never runs (it makes the clip chunk by chunk on its clean past).",
                "drop --regression_weight; start from an --method ode_init student instead (docs/streaming.md)",
            )
        check_rollout_frames(cfg.rollout_frames, cfg.num_frames, chunk)
    if not chunk:
        return
    frames = latent_frames(cfg.num_frames)
    if frames % chunk:
        counts = ", ".join(str(n) for n in frame_counts(chunk, cfg.num_frames))
        raise _refuse(
            f"--num_frames {cfg.num_frames} is {frames} latent frames, not whole chunks of "
            f"--student_chunk_frames {chunk}",
            "A causal student makes the clip in whole chunks.",
            f"use --num_frames {counts} (or another --student_chunk_frames)",
        )


def check_rollout_frames(rollout: int | None, num_frames: int, chunk: int) -> None:
    """Refuse a --rollout_frames a causal student cannot stream: shorter than the clip the teacher
    judges, or not whole chunks. None, 0 and --num_frames itself are the clip's own rollout."""
    if rollout in (None, 0, num_frames):
        return
    assert rollout is not None
    three_times = (3 * latent_frames(num_frames) - 1) * TEMPORAL_STRIDE + 1  # 3x the clip's chunks
    counts = ", ".join(str(n) for n in frame_counts(chunk, three_times))
    if rollout < num_frames:
        raise _refuse(
            f"--rollout_frames {rollout} is shorter than --num_frames {num_frames}",
            "The teacher and the critic judge a window of --num_frames frames of the rollout, so the "
            "rollout is at least that long.",
            f"use --rollout_frames {counts} (3x and on), or leave it out to roll out the clip",
        )
    if rollout % TEMPORAL_STRIDE != 1 or latent_frames(rollout) % chunk:
        raise _refuse(
            f"--rollout_frames {rollout} is not whole chunks of --student_chunk_frames {chunk}",
            f"The student streams whole chunks of {chunk} latent frame(s) ({TEMPORAL_STRIDE} frames each "
            "after the first).",
            f"use --rollout_frames {counts}",
        )
