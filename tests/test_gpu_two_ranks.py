"""The two-rank LoRA run with the experts sharded, on NCCL and two GPUs: what tests/test_lora.py checks
on gloo and CPUs, on the backend and devices a real run uses. Skipped without two CUDA devices;
`make gpu-check` (distill/gpu_check.py) runs it as its own step.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import assert_same_trajectory, launch
from test_lora import lora_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_a_sharded_lora_run_on_two_gpus_over_nccl_matches_whole_experts(tiny_teacher, tmp_path):
    # float32 teacher: the comparison is about sharding and NCCL, not about bf16 rounding (auto = bf16).
    common = dict(
        batch_size=1,
        num_steps=4,
        gradient_checkpointing=True,
        seed=2,
        device="auto",
        backend="nccl",
        teacher_dtype="float32",
    )
    for placement in ("shard", "gpu"):
        args = lora_args(
            tiny_teacher, tmp_path / placement, tmp_path / "cache", teacher_placement=placement, **common
        )
        stderr = launch(args, nproc=2).stderr
        assert f"teacher placement: {placement}" in stderr
    assert "all 2 ranks hold identical student and critic weights" in stderr
    # GPU kernels and NCCL's reduction order move float sums more than gloo on CPUs (1e-5 there).
    keys = ("loss", "grad_norm", "critic_loss", "critic_grad_norm")
    assert_same_trajectory([tmp_path / "shard", tmp_path / "gpu"], first_rtol=1e-3, rtol=1e-2, keys=keys)
