"""What a checkpoint must agree with to be resumed: the student, the teacher's weights, the prompts,
the training target and the method's own settings. Saved in every checkpoint's meta.json; a resume
with other values is refused with the options that changed (or warned about with --force_resume)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distill.config.settings import TrainConfig, canonical_lora_targets
from distill.data.samples import TrainingSample
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.ops.replace import free_sibling
from distill.train.methods import method_class

logger = logging.getLogger(__name__)


def run_identity(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], prompts: list[str], shift: float
) -> dict[str, Any]:
    """This run's identity, as it reads back from meta.json."""
    identity = {
        "student_config": student_config,
        # The base teacher's files; the LoRAs fused into it (--teacher_lora) apart, so that a resume
        # with other ones is told which changed.
        "teacher": info.fingerprint(*info.expert_folders, with_loras=False),
        "teacher_loras": teacher_lora_record(info),
        "prompts": hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16],
        # What the student regresses onto: another value is another objective (as resolved,
        # so --flow_shift 3.0 equals a teacher default of 3.0). Keys are the option names.
        "target": {
            "guidance_scale": cfg.guidance_scale,
            "guidance_scale_2": cfg.guidance_scale_2,
            "negative_prompt": cfg.negative_prompt,
            "flow_shift": shift,
            "boundary_ratio": info.boundary_ratio,
            "max_sequence_length": cfg.max_sequence_length,
        },
        "method": cfg.method,
        # A causal student's chunks (None: bidirectional, as every checkpoint before they existed).
        "student_chunk_frames": cfg.student_chunk_frames or None,
        **method_class(cfg.method).identity(cfg),
        **(
            {
                "lora": {
                    "rank": cfg.student_lora_rank,
                    "alpha": cfg.lora_alpha,
                    "targets": list(cfg.lora_targets),
                    "critic_rank": cfg.critic_adapter_rank if cfg.trains_critic else None,
                    **({"expert_phase": cfg.expert_phase} if cfg.expert_phase != "both" else {}),
                }
            }
            if cfg.student_lora_rank
            else {}
        ),
    }
    return json.loads(json.dumps(identity))  # as it reads back from meta.json (tuples become lists)


def teacher_lora_record(info: TeacherInfo) -> list[dict[str, Any]]:
    """Each fused LoRA's file name, expert, scale and content hash (the folder it sits in may move)."""
    return [{**lora.record(), "file": lora.path.name} for lora in info.loras]


def sample_record(samples: Sequence[TrainingSample]) -> list[list[str | None]]:
    """Each sample's prompt hash and image key, in order: stored beside the identity (whose "prompts"
    is one hash of them all) so that a resume on changed data can say which prompt or image changed."""
    return [
        [hashlib.sha256(sample.prompt.encode()).hexdigest()[:12], (sample.image_key or "")[:12] or None]
        for sample in samples
    ]


def _where(sample: TrainingSample, index: int) -> str:
    if sample.image is not None:
        return f"{sample.image.where} ({sample.prompt!r}, image {sample.image.image})"
    return f"prompt {index + 1} of --data_path ({sample.prompt!r})"


def samples_changed(saved: object, samples: Sequence[TrainingSample]) -> str:
    """What differs between the samples a checkpoint recorded (`sample_record`) and this run's, in
    words: the first prompt or image that changed, named by file and line, and the counts."""
    if not isinstance(saved, list):
        return (
            "(the checkpoint records only the hash of its prompts, not which ones: it predates that record)"
        )
    current = sample_record(samples)
    lines = []
    if len(saved) != len(current):
        lines.append(f"the checkpoint's run had {len(saved)} samples, this run has {len(current)}")
    for index, (before, now) in enumerate(zip(saved, current, strict=False)):
        if list(before) == now:
            continue
        where = _where(samples[index], index)
        if before[0] == now[0]:
            lines.append(f"{where}: the same prompt, but the image's content changed since the checkpoint")
        elif before[1] is not None and before[1] == now[1]:
            lines.append(f"{where}: the same image, but the prompt changed since the checkpoint")
        else:
            lines.append(f"{where}: not the sample the checkpoint's run had there")
        break
    return "\n".join(lines) or "the same samples in another order"


# The flag behind each entry of a checkpoint's "lora" identity.
LORA_OPTIONS = {
    "rank": "--student_lora_rank",
    "alpha": "--student_lora_alpha",
    "targets": "--student_lora_targets",
    "critic_rank": "--critic_lora_rank",
    "expert_phase": "--expert_phase",
}


def lora_flags(lora: dict[str, Any]) -> str:
    """The flags that give a run the LoRA adapters a checkpoint records (its identity's "lora")."""
    flags = [
        f"--student_lora_rank {lora.get('rank')}",
        f"--student_lora_alpha {float(lora.get('alpha') or 0):g}",
        f"--student_lora_targets {','.join(lora.get('targets') or [])}",
    ]
    if lora.get("critic_rank") is not None and lora.get("critic_rank") != lora.get("rank"):
        flags.append(f"--critic_lora_rank {lora['critic_rank']}")
    if lora.get("expert_phase"):
        flags.append(f"--expert_phase {lora['expert_phase']}")
    return " ".join(flags)


def recorded_settings(path: Path) -> dict[str, Any]:
    """The settings of the run that wrote the checkpoint `path` (<output_dir>/checkpoints/step_N), as
    its run_config.json holds them; {} when there is none to read."""
    try:
        recorded = json.loads((path.parent.parent / "run_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def other_kind_of_student(path: Path, saved: dict[str, Any], expected: dict[str, Any]) -> DistillError | None:
    """A LoRA run's checkpoint resumed by a run of a separate student, or the reverse: refused even with
    --force_resume (adapters and a whole model cannot load into each other), naming what the checkpoint
    is and the flags that continue it."""
    if "student_config" not in saved or ("lora" in saved) == ("lora" in expected):
        return None  # an identity from before checkpoints recorded one, or the same kind of student
    settings = path.parent.parent / "run_config.json"
    recorded = recorded_settings(path)
    if "lora" in saved:
        lora = saved["lora"] if isinstance(saved["lora"], dict) else {}
        return DistillError(
            f"checkpoint {path} was made with a different kind of student: it holds a LoRA run's adapters "
            f"(rank {lora.get('rank')} on the teacher's experts), and this run trains a separate student",
            f"checkpoint: LoRA adapters, {lora_flags(lora)}\nthis run:   a separate student (--student_config)",
            fixes=[
                f"continue the LoRA run: {lora_flags(lora)}, without --student_config and --student_init",
                "or train the separate student in another --output_dir",
            ],
            stage=Stage.CHECKPOINT,
        )
    config = recorded.get("student_config")
    lora = expected["lora"]
    return DistillError(
        f"checkpoint {path} was made with a different kind of student: it holds a separate student, and "
        f"this run trains LoRA adapters (rank {lora.get('rank')}) on the teacher's experts",
        f"checkpoint: a separate student{f' (--student_config {config}, in {settings})' if config else ''}\n"
        f"this run:   LoRA adapters, {lora_flags(lora)}",
        fixes=[
            "continue the separate student: drop --student_lora_rank (and the other LoRA flags)"
            + (f" and pass --student_config {config}" if config else " and pass its --student_config"),
            "or train the LoRA adapters in another --output_dir",
        ],
        stage=Stage.CHECKPOINT,
    )


def _loras_in_words(record: object) -> str:
    if not isinstance(record, list) or not record:
        return "none"
    return "; ".join(
        f"{r.get('file')} on {r.get('expert')} at scale {r.get('scale')} (sha256 {r.get('sha256')})"
        for r in record
        if isinstance(r, dict)
    )


# Identity keys whose change leaves the checkpoint's weights loadable into this run: --force_resume
# can continue it. Another student config or method holds other tensors, which no flag loads.
FORCEABLE = {"teacher", "teacher_loras", "prompts", "target"}


def check_identity(
    path: Path,
    meta: dict[str, Any],
    expected: dict[str, Any],
    force: bool,
    samples: Sequence[TrainingSample] = (),
    end: int | None = None,
) -> None:
    """Refuse to resume the checkpoint at `path` made with another identity (unless `force`). The
    fixes are those that work here: another --output_dir first; continuing that run only where it has
    steps left (`end`: this run's last step, None where it is not counted yet), and --force_resume only
    where its weights load. `samples`: this run's, to name a prompt or image that changed."""
    output_dir = path.parent.parent
    finished = end is not None and int(meta.get("step", 0)) >= end
    kind = other_kind_of_student(path, meta.get("identity", {}), expected)
    if kind is not None:
        raise kind
    for key, value in expected.items():
        saved = meta.get("identity", {}).get(key)
        if key == "method" and saved is None:
            saved = "velocity"  # checkpoints from before --method existed
        if key == "teacher_loras" and saved is None:
            saved = []  # checkpoints from before --teacher_lora existed: a teacher without LoRAs
        if key == "lora" and isinstance(saved, dict) and isinstance(saved.get("targets"), list):
            # Checkpoints from before the targets were stored canonically: same modules, same lora.
            saved = {**saved, "targets": list(canonical_lora_targets(saved["targets"]))}
        if saved == value:
            continue
        if key == "target" and saved is None:
            logger.warning("checkpoint %s does not record its training target; not checked", path)
            continue
        if isinstance(value, dict) and isinstance(saved, dict):
            keys = sorted(k for k in set(saved) | set(value) if saved.get(k) != value.get(k))
            saved, value = {k: saved.get(k) for k in keys}, {k: value.get(k) for k in keys}
        what = key.replace("_", " ")
        details = f"checkpoint: {saved}\nthis run:   {value}"
        if key == "prompts":
            what = "set of prompts and images (--data_path)"
            details = (
                samples_changed(meta.get("samples"), samples)
                + f"\n(hashes: checkpoint {saved}, this run {value})"
            )
        settings = output_dir / "run_config.json"
        fixes = [
            f"start this run in another --output_dir: --output_dir {free_sibling(output_dir)}",
            *(
                [f"or continue that run with the settings it was made with ({settings})"]
                if not finished
                else []
            ),
            *(
                ["or pass --force_resume if the change is intended (the weights are loaded as they are)"]
                if key in FORCEABLE and not finished
                else []
            ),
        ]
        if finished:
            details += (
                f"\nThat run is finished (its checkpoint is at step {meta.get('step')}, this run ends at step "
                f"{end}): continuing it would train nothing."
            )
        if key == "teacher_loras":
            what = "set of teacher LoRAs (--teacher_lora)"
            details = f"checkpoint: {_loras_in_words(saved)}\nthis run:   {_loras_in_words(value)}"
        if key == "target":  # name the options that changed
            what = "training target: " + ", ".join(f"--{k}" for k in value)
        if key == "student_config" and "lora" in expected:
            # A LoRA student is the teacher's own experts: their config is the teacher's, not a flag.
            what = "teacher (its experts' config)"
            teacher = recorded_settings(path).get("teacher_path") or "TEACHER"
            fixes = [
                f"resume with the teacher the checkpoint was made with: --teacher_path {teacher} (the LoRA "
                "student is that teacher's experts)",
                f"or start fresh in another --output_dir: --output_dir {free_sibling(output_dir)}",
            ]
        if key == "lora" and isinstance(value, dict) and isinstance(saved, dict):
            what = "lora (" + ", ".join(LORA_OPTIONS.get(k, k) for k in value) + ")"
            # Adapters of another rank, targets or critic cannot load into this run's, forced or not.
            loadable = set(value) <= {"alpha", "expert_phase"}
            fixes = [
                f"resume with the checkpoint's adapters: {lora_flags(meta['identity']['lora'])}",
                "or start fresh in another --output_dir",
                *(
                    ["or pass --force_resume if the change is intended (the adapters are loaded as they are)"]
                    if loadable
                    else []
                ),
            ]
            if force and not loadable:
                raise DistillError(
                    f"checkpoint {path} was made with a different {what}; --force_resume cannot load "
                    "adapters of another shape",
                    f"checkpoint: {saved}\nthis run:   {value}",
                    fixes=fixes,
                    stage=Stage.CHECKPOINT,
                )
        if force:
            logger.warning(
                "resuming %s although it was made with a different %s (--force_resume)", path, what
            )
            continue
        raise DistillError(
            f"checkpoint {path} was made with a different {what}",
            details,
            fixes=fixes,
            stage=Stage.CHECKPOINT,
        )
