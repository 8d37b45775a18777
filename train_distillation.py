"""Distil the Wan 2.2 A14B teacher into a compact WanTransformer3DModel student.

    python train_distillation.py \\
        --teacher_path Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --student_config config/student_config.json \\
        --data_path data/static_prompts.txt \\
        --output_dir outputs/run1

`python train_distillation.py --help` lists every setting; `--config run.yaml` reads them from a file.
The student is written to <output_dir>/student/ in diffusers format.
"""

from __future__ import annotations

import logging
import sys


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # diffusers/transformers are chatty at INFO; their warnings still show.
    for name in ("diffusers", "transformers", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    from distill.config import parse_config
    from distill.errors import DistillError, report

    setup_logging()
    try:
        cfg = parse_config(argv)
        from distill.trainer import Distiller

        distiller = Distiller(cfg)
        if cfg.dry_run:
            print("dry run: every setting, the teacher layout, the student config and the prompts are valid.")
            print(distiller.plan())
            return 0
        result = distiller.run()
    except DistillError as error:
        return report(error)
    print(f"done: {result.steps} steps, loss {result.first_loss:.4g} -> {result.last_loss:.4g}")
    print(f"student (diffusers format): {result.student_dir}")
    if result.ema_dir:
        print(f"EMA student:               {result.ema_dir}")
    print(f"metrics:                   {result.output_dir / 'metrics.jsonl'}")
    print(f"checkpoints:               {result.output_dir / 'checkpoints'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
