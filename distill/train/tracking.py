"""Where numbers go: the progress bar, `<output_dir>/metrics.jsonl` and wandb. Rank 0 only.

wandb is a guest: if it cannot start or loses its connection, training goes on, the problem is
reported once, and metrics.jsonl still has every logged step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class Tracker:
    """Progress bar, metrics file and (optional) wandb run for the main process; silent elsewhere."""

    def __init__(
        self,
        output_dir: str | Path,
        enabled: bool,
        total_steps: int,
        start_step: int,
        wandb_project: str | None = None,
        wandb_mode: str = "online",
        wandb_run_name: str | None = None,
        wandb_run_id: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.metrics_path = Path(output_dir) / "metrics.jsonl"
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="distill", disable=not enabled, dynamic_ncols=True
        )
        self.run = None
        self._last_time = time.perf_counter()
        self._last_step = start_step
        if enabled and wandb_project and wandb_mode != "disabled":
            self.run = self._start_wandb(
                output_dir, wandb_project, wandb_mode, wandb_run_name, wandb_run_id, config
            )

    @property
    def wandb_run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def _start_wandb(self, output_dir, project, mode, name, run_id, config) -> Any:
        if mode == "online" and not has_wandb_key():
            logger.warning(
                "wandb: no API key found (WANDB_API_KEY or `wandb login`); logging offline instead"
            )
            mode = "offline"
        try:
            import wandb

            return wandb.init(
                project=project,
                mode=mode,
                name=name,
                id=run_id,
                resume="allow" if run_id else None,
                dir=str(output_dir),
                config=config,
            )
        except Exception as exc:
            logger.warning(
                "wandb could not start (%s: %s); training continues without it", type(exc).__name__, exc
            )
            return None

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one logged step everywhere. `metrics` are plain floats (already synced), None
        where a skipped step has nothing to report."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if step > self._last_step:
            metrics = {**metrics, "steps_per_s": (step - self._last_step) / max(now - self._last_time, 1e-9)}
        self._last_time, self._last_step = now, step
        record = {"step": step, **metrics}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        # A dmd step without a generator update has only the critic's numbers; null = skipped.
        shown = {
            k: "skipped" if metrics[k] is None else f"{metrics[k]:.4g}"
            for k in ("loss", "critic_loss")
            if k in metrics
        }
        self.bar.set_postfix(
            shown, lr=f"{metrics.get('lr', metrics.get('critic_lr', 0.0)):.2e}", refresh=False
        )
        if self.run is not None:
            try:
                # null means "nothing to report" (a skipped step): wandb gets no point, not a zero
                self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
            except Exception as exc:
                logger.warning(
                    "wandb logging failed (%s: %s); continuing without wandb", type(exc).__name__, exc
                )
                self.run = None

    def log_media(self, step: int, files: list[Path], metrics: dict[str, float] | None = None) -> None:
        """Samples, grids and report plots (already written to disk) plus report numbers, under `step`."""
        if not self.enabled or (not files and not metrics):
            return
        if metrics:
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            try:
                self.run.log({**wandb_media(files), **(metrics or {})}, step=step)
            except Exception as exc:
                logger.warning(
                    "wandb media logging failed (%s: %s); continuing without wandb", type(exc).__name__, exc
                )
                self.run = None

    def close(self) -> None:
        self.bar.close()
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as exc:
                logger.warning("wandb did not finish cleanly (%s)", exc)
            self.run = None


def wandb_media(files: Sequence[Path]) -> dict[str, Any]:
    """wandb media for written files, keyed by kind: pass to `run.log(..., step=step)`.

    Images and videos are logged by path (a wandb.Video from an array would need moviepy).
    """
    import wandb

    media: dict[str, Any] = {}
    for path in map(Path, files):
        if path.name == "eval.json":
            continue
        if path.name == "eval.png":
            key = "eval/plot"
        elif path.name.startswith("grid_"):
            # The still grid, and for clips the GIF that plays teacher above student.
            key = "samples/grid_clips" if path.suffix == ".gif" else "samples/grid"
        else:
            who, _, index = path.stem.rpartition("_prompt_")
            key = f"{'teacher' if who == 'teacher' else 'samples'}/prompt_{index}"
        if path.suffix in (".mp4", ".gif"):
            media[key] = wandb.Video(str(path), format=path.suffix[1:])
        else:
            media[key] = wandb.Image(str(path))
    return media
