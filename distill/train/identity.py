"""What a checkpoint must agree with to be resumed: the student, the teacher's weights, the prompts,
the training target and the method's own settings. Saved in every checkpoint's meta.json; a resume
with other values is refused with the options that changed (or warned about with --force_resume)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.train.methods import method_class

logger = logging.getLogger(__name__)


def run_identity(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], prompts: list[str], shift: float
) -> dict[str, Any]:
    """This run's identity, as it reads back from meta.json."""
    identity = {
        "student_config": student_config,
        "teacher": info.fingerprint("transformer", "transformer_2"),
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
        **method_class(cfg.method).identity(cfg),
        **(
            {
                "lora": {
                    "rank": cfg.student_lora_rank,
                    "alpha": cfg.lora_alpha,
                    "targets": list(cfg.lora_targets),
                    "critic_rank": cfg.critic_adapter_rank if cfg.method == "dmd" else None,
                    **({"expert_phase": cfg.expert_phase} if cfg.expert_phase != "both" else {}),
                }
            }
            if cfg.student_lora_rank
            else {}
        ),
    }
    return json.loads(json.dumps(identity))  # as it reads back from meta.json (tuples become lists)


def check_identity(path: Path, meta: dict[str, Any], expected: dict[str, Any], force: bool) -> None:
    """Refuse to resume the checkpoint at `path` made with another identity (unless `force`)."""
    for key, value in expected.items():
        saved = meta.get("identity", {}).get(key)
        if key == "method" and saved is None:
            saved = "velocity"  # checkpoints from before --method existed
        if saved == value:
            continue
        if key == "target" and saved is None:
            logger.warning("checkpoint %s does not record its training target; not checked", path)
            continue
        if isinstance(value, dict) and isinstance(saved, dict):
            keys = sorted(k for k in set(saved) | set(value) if saved.get(k) != value.get(k))
            saved, value = {k: saved.get(k) for k in keys}, {k: value.get(k) for k in keys}
        what = key.replace("_", " ")
        if key == "target":  # name the options that changed
            what = "training target: " + ", ".join(f"--{k}" for k in value)
        if force:
            logger.warning(
                "resuming %s although it was made with a different %s (--force_resume)", path, what
            )
            continue
        raise DistillError(
            f"checkpoint {path} was made with a different {what}",
            f"checkpoint: {saved}\nthis run:   {value}",
            fixes=[
                "resume with the settings the checkpoint was made with",
                "or start fresh in another --output_dir",
                "or pass --force_resume if the change is intended (the weights are loaded as they are)",
            ],
            stage=Stage.CHECKPOINT,
        )
