"""Checkpoints that survive crashes: written aside, flushed, marked complete, then renamed into place.

Layout: `<output_dir>/checkpoints/step_00000120/` holding `student.safetensors` (and one
`<name>.safetensors` per other trained model, e.g. `critic.safetensors`), `state.pt`
(optimizer, LR schedule, grad scaler, EMA, RNG states) and `meta.json` (step, samples seen,
run identity), and a `COMPLETE` marker written last. A folder without the marker is a crashed
save and is never resumed from; older checkpoints are pruned only after a newer one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from distill.ops.errors import DistillError, Stage
from distill.ops.files import disk_is_full, fsync_tree

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
PREFIX = "step_"
PRUNING = ".pruning-"  # a checkpoint being deleted
STEP_FOLDER = re.compile(rf"{PREFIX}\d+")


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, torch.Tensor]
    state: dict[str, Any]
    meta: dict[str, Any]
    models: dict[str, dict[str, torch.Tensor]] = field(
        default_factory=dict
    )  # trained models besides the student

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(
    root: Path,
    step: int,
    model: dict[str, torch.Tensor],
    state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
    extra_models: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write a complete checkpoint for `step`, then prune all but the newest `keep_last`.

    `extra_models` (e.g. a critic) are written beside the student as `<name>.safetensors`.
    """
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in model.items()}, str(tmp / "student.safetensors")
        )
        for name, weights in (extra_models or {}).items():
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in weights.items()},
                str(tmp / f"{name}.safetensors"),
            )
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2, sort_keys=True))
        (tmp / MARKER).write_text("ok\n")  # last: its presence means every file above is whole
        fsync_tree(tmp)
        if final.exists():  # a re-save of the same step (after a resume): replace it only now
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as exc:  # OSError, or torch's / safetensors' own words for a failed write
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_is_full(exc, root)
        raise DistillError(
            ("the disk is full: " if full else "")
            + f"could not write the checkpoint for step {step} in {root}",
            f"{type(exc).__name__}: {exc}",
            causes=[
                "the disk is full",
                "the output folder is not writable",
                "a network filesystem went away",
            ],
            fixes=[
                "free space (df -h) or point --output_dir at a larger, writable disk",
                "then rerun the same command: it resumes from the last complete checkpoint, which is intact"
                + (f" ({complete_checkpoints(root)[-1]})" if complete_checkpoints(root) else ""),
            ],
            stage=Stage.CHECKPOINT,
        ) from None
    prune(root, keep_last)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    # Only our own names: a user's copy beside them ("step_00000004.bak", "step_4 old") is left alone.
    found = [
        p for p in root.iterdir() if STEP_FOLDER.fullmatch(p.name) and p.is_dir() and (p / MARKER).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and what killed saves and prunes left.

    A checkpoint is first renamed out of the step_* names (atomic), then deleted: a process killed
    halfway through deleting it must not leave a folder that still carries its COMPLETE marker
    but lacks its weights. Only one run writes into a folder at a time (distill/ops/output_dir.py),
    so every leftover of another process is stale.
    """
    for old in complete_checkpoints(root)[:-keep_last]:
        doomed = root / f"{PRUNING}{old.name}-{os.getpid()}"
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for leftover in root.iterdir():
        stale_save = leftover.name.startswith(".tmp-") and not leftover.name.endswith(f"-{os.getpid()}")
        if stale_save or leftover.name.startswith(PRUNING):
            shutil.rmtree(leftover, ignore_errors=True)


def resume_problem(path: Path) -> DistillError | None:
    """Why the folder `--resume` names is not one checkpoint to resume, or None when it is one.

    Checked before anything loads (the teacher, the caches) and again when the checkpoint is read.
    The folders people pass instead are named as what they are: a run's `checkpoints/` folder or
    the run's output folder (pass one of its step folders), and a step folder whose save was
    interrupted (no COMPLETE marker).
    """
    if (path / MARKER).is_file():
        return None
    inside = next((root for root in (path, checkpoint_root(path)) if _step_folders(root)), None)
    if inside is not None:
        complete = complete_checkpoints(inside)
        what = "a run's checkpoints folder" if inside == path else "a run's output folder"
        owner = inside.parent
        return DistillError(
            f"--resume {path} is {what}, not one checkpoint",
            f"It holds the step folders of {owner}: --resume takes one of them "
            f"({', '.join(p.name for p in _step_folders(inside)[-3:])}), or auto.",
            fixes=[
                *(
                    [f"pass one of its step_N folders: --resume {complete[-1]} (the newest complete one)"]
                    if complete
                    else []
                ),
                f"or --resume auto with --output_dir {owner} (the newest complete checkpoint of that run)",
            ],
            stage=Stage.CHECKPOINT,
        )
    if STEP_FOLDER.fullmatch(path.name) or (path / "meta.json").is_file():
        older = complete_checkpoints(path.parent)
        return DistillError(
            f"{path} is not a complete checkpoint (no {MARKER} marker: the save was interrupted)",
            fixes=[
                *([f"pass the newest complete one: --resume {older[-1]}"] if older else []),
                "or --resume auto to use the newest complete checkpoint in --output_dir",
            ],
            stage=Stage.CHECKPOINT,
        )
    return DistillError(
        f"--resume {path} is not a checkpoint folder (no {MARKER} marker, no step_N folders)",
        f"A checkpoint is a folder <output_dir>/checkpoints/step_N holding {MARKER}, meta.json and the weights.",
        fixes=[
            "pass one of a run's <output_dir>/checkpoints/step_N folders",
            "or --resume auto to use the newest complete checkpoint in --output_dir",
        ],
        stage=Stage.CHECKPOINT,
    )


def check_resume_flag(resume: str) -> None:
    """Refuse a --resume folder that is no checkpoint (`resume_problem`) before the run does any
    work, not when the loop comes to read it after the caches were built."""
    if resume not in ("auto", "none"):
        problem = resume_problem(Path(resume))
        if problem is not None:
            raise problem


def _step_folders(root: Path) -> list[Path]:
    """Every step folder in `root`, complete or not, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_FOLDER.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def load_checkpoint(path: Path) -> Checkpoint:
    problem = resume_problem(path)
    if problem is not None:
        raise problem
    try:
        model = load_file(str(path / "student.safetensors"))
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        meta = json.loads((path / "meta.json").read_text())
        others = {
            f.stem: load_file(str(f)) for f in sorted(path.glob("*.safetensors")) if f.stem != "student"
        }
    except Exception as exc:  # truncated, overwritten or unreadable files: whichever library noticed
        older = [p for p in complete_checkpoints(path.parent) if p != path]
        raise DistillError(
            f"checkpoint {path} is damaged and cannot be loaded",
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            causes=["a file was truncated or overwritten after the save (a copy, a sync tool, a full disk)"],
            fixes=[
                "--resume auto: the newest checkpoint that loads"
                + (f" (here: {older[-1].name})" if older else ""),
                f"or --resume with another folder of {path.parent}",
            ],
            stage=Stage.CHECKPOINT,
        ) from None
    return Checkpoint(path, model, state, meta, others)


def load_latest(root: Path) -> Checkpoint | None:
    """The newest checkpoint that loads; damaged ones are skipped with a warning naming them."""
    for path in reversed(complete_checkpoints(root)):
        try:
            return load_checkpoint(path)
        except Exception as exc:  # a truncated or corrupt file: fall back to an older checkpoint
            logger.warning("skipping damaged checkpoint %s (%s: %s)", path, type(exc).__name__, exc)
    return None


def refuse_past_end(path: Path, step: int, total_steps: int, by_epochs: bool) -> None:
    """Refuse to resume a checkpoint that is already past this run's last step.

    Such a run would train nothing and export the checkpoint's later weights while run_config.json
    recorded the lower step count: the folder would then say one thing and hold another.
    """
    if step <= total_steps:
        return
    setting = f"--num_epochs gives {total_steps} steps" if by_epochs else f"--num_steps is {total_steps}"
    raise DistillError(
        f"checkpoint {path} is at step {step}, past the end of this run ({setting})",
        "Resuming it would train nothing and export the weights of step "
        f"{step} under a run_config.json that says {total_steps}. Nothing was changed.",
        fixes=[
            f"--num_steps {step} (or more) continues that run, or exports it again",
            "for a shorter run, start it in another --output_dir",
        ],
        stage=Stage.CHECKPOINT,
    )


def rng_state() -> dict[str, Any]:
    """Global RNG states, so code that draws from them continues the same after a resume."""
    import random

    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_ema(ema: Any, state: dict[str, Any], device: torch.device) -> None:
    """Load an `EMAModel` state read from a checkpoint and move its shadow weights to `device`.

    Checkpoints load onto the CPU (map_location) and `EMAModel.load_state_dict` keeps the tensors
    where they are, so without the move the first `ema.step` on a GPU mixes CPU and CUDA tensors.
    """
    ema.load_state_dict(state)
    ema.to(device=device)
