"""The memory plan against a real device: what `--dry_run` plans for one model's forward and backward
(measured on fake tensors with CPU autocast, distill/train/activations.py) beside what the same model
really allocates on this machine's device, case by case. A benchmark: it prints numbers, asserts nothing.

    python -m distill.bench.plan_check                      # CUDA: the real-size cases below
    python -m distill.bench.plan_check --device cpu --small # any machine: the same cases, tiny

The plan's CPU figures were checked against CPU training steps (tests/test_memory_plan.py); on CUDA
the kernels differ (flash attention, CUDA autocast's op lists, cuBLAS workspaces), which only a GPU
can show. Each row is bytes above the model's weights: `held` after the forward (what backward
keeps), `peak` over forward + loss + backward, or the peak of a forward without gradient (`no_grad`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from distill.bench.settings import A14B_EXPERT, SMALL_EXPERT
from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.paths import Kind, PathFlag, check_paths
from distill.train.activations import DTYPES, ModelUse, as_used, no_grad_peak, trained

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
GB = 1e9


@dataclass(frozen=True)
class Case:
    name: str
    use: ModelUse
    with_grad: bool = True


def student_config() -> dict[str, Any]:
    from distill.bench.settings import REPO

    config = json.loads((REPO / "config/student_config.json").read_text())
    return {k: v for k, v in config.items() if not k.startswith("_")}


def cases(small: bool) -> list[Case]:
    """The shapes the recipes run: a 1.3B student (fp32 weights, bf16 autocast) at one frame and at 81
    frames checkpointed; LoRA on an A14B-wide expert (bf16); the teacher's forward without gradient."""
    student = student_config()
    expert = {**A14B_EXPERT, "num_layers": 4}
    full = dict(A14B_EXPERT)
    frame, clip = (16, 1, 60, 104), (16, 21, 60, 104)
    if small:
        student = {**SMALL_EXPERT, "num_layers": 4}
        expert = {**SMALL_EXPERT, "num_layers": 4}
        full = {**SMALL_EXPERT, "num_layers": 8}
        frame, clip = (16, 1, 16, 16), (16, 5, 16, 16)
    lora = {"lora_rank": 64, "lora_alpha": 64.0, "lora_targets": LORA_TARGETS}
    return [
        Case(
            "student, 4 x 1 frame",
            ModelUse.of(student, latent_shape=frame, text_len=512, batch=4, autocast="bfloat16"),
        ),
        Case(
            "student, 81 frames, ckpt",
            ModelUse.of(
                student, latent_shape=clip, text_len=512, batch=1, autocast="bfloat16", checkpointing=True
            ),
        ),
        Case(
            "LoRA expert, 81 frames, ckpt",
            ModelUse.of(
                expert,
                latent_shape=clip,
                text_len=512,
                batch=1,
                weights="bfloat16",
                checkpointing=True,
                **lora,
            ),
        ),
        Case(
            "teacher expert, 2 x 81 frames",
            ModelUse.of(expert, latent_shape=clip, text_len=512, batch=2, weights="bfloat16"),
            with_grad=False,
        ),
        # The LoRA recipe's expert at its full depth: the plan extends 2- and 3-block measurements.
        Case(
            "LoRA expert, full depth, 81 fr",
            ModelUse.of(
                full, latent_shape=clip, text_len=512, batch=1, weights="bfloat16", checkpointing=True, **lora
            ),
        ),
    ]


def planned(case: Case) -> tuple[float, float]:
    if case.with_grad:
        plan = trained(case.use)
        return plan.held, plan.peak
    return float("nan"), no_grad_peak(case.use)


def real_model(use: ModelUse, device: torch.device) -> torch.nn.Module:
    """The model of `use` with random weights, built on `device` (no CPU copy of a 14B-wide block)."""
    from distill.models.student import build_student

    with torch.device(device):
        model = as_used(build_student(json.loads(use.config)), use).to(device)  # adapters too
    if use.checkpointing:
        model.enable_gradient_checkpointing()
    return model


class Allocated:
    """Bytes allocated on `device` now and at the peak since `reset` (CUDA: the caching allocator's
    counters; CPU: live tensor storages, as the plan's own tests measure)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counter: Any = None

    def reset(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return float(torch.cuda.memory_allocated())
        from distill.ops.live_memory import LiveTensorMemory

        self.counter = LiveTensorMemory().__enter__()
        return 0.0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return float(torch.cuda.memory_allocated())
        return float(self.counter.live)

    def peak(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated())
        peak = float(self.counter.peak)
        self.counter.__exit__(None, None, None)
        return peak


def measured(case: Case, device: torch.device) -> tuple[float, float]:
    """What `case` allocates above its weights on `device`: the same inputs, loss and autocast the plan
    runs (distill/train/activations.py), with real tensors and the device's own autocast."""
    from distill.models.flow_matching import per_sample_mse

    use = case.use
    model = real_model(use, device)
    model.train(case.with_grad)
    for p in model.parameters():
        p.grad = None
    text_dim = int(json.loads(use.config)["text_dim"])
    dtype = DTYPES[use.weights]
    autocast = torch.autocast(
        device.type, dtype=DTYPES[use.autocast or "bfloat16"], enabled=use.autocast is not None
    )
    memory = Allocated(device)
    base = memory.reset()
    inputs = {
        "hidden_states": torch.randn(use.batch, *use.latent_shape, device=device).to(dtype),
        "timestep": torch.full((use.batch,), 500, dtype=torch.long, device=device),
        "encoder_hidden_states": torch.randn(use.batch, use.text_len, text_dim, device=device).to(dtype),
    }
    held = float("nan")
    if case.with_grad:
        target = torch.randn(use.batch, *use.latent_shape, device=device)
        with autocast:
            prediction = model(**inputs, return_dict=False)[0]
        held = memory.now() - base
        per_sample_mse(prediction, target).mean().backward()
    else:
        with torch.no_grad(), autocast:
            model(**inputs, return_dict=False)
    peak = memory.peak() - base
    del model, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return held, peak


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.bench.plan_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes (any machine, seconds)")
    parser.add_argument(
        "--json",
        action=PathAction,
        kind=Kind.OUTPUT_FILE,
        example="plan_check.json",
        help="also write the rows to this file",
    )
    args = parser.parse_args(argv)
    # Before the cases run, not after: a --json that cannot be written would throw their minutes away.
    check_paths([PathFlag("--json", args.json, Kind.OUTPUT_FILE, example="plan_check.json")])
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("plan_check: torch sees no CUDA device; run with --device cpu --small on this machine")
        return 0
    print(f"{'case':32} {'':8} {'plan GB':>9} {'real GB':>9} {'real/plan':>9}")
    rows = []
    for case in cases(args.small):
        plan = planned(case)
        real = measured(case, device)
        for what, p, r in zip(("held", "peak" if case.with_grad else "no_grad"), plan, real):
            if p != p:  # nan: a forward without gradient has no `held`
                continue
            ratio = r / p if p else float("nan")
            print(f"{case.name:32} {what:8} {p / GB:9.3f} {r / GB:9.3f} {ratio:9.3f}", flush=True)
            rows.append({"case": case.name, "what": what, "plan_bytes": p, "real_bytes": r, "ratio": ratio})
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)  # as --json promises
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
