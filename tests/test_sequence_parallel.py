"""Sequence parallel (--sequence_parallel, diffusers' Ulysses context parallel) on CPU with gloo:
two ranks splitting each sample's tokens train like one process; degrees a run cannot use are
refused before the teacher loads."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    REPO,
    TEACHER_SHAPE,
    WARM_TORCHRUN,
    repo_pythonpath,
    run_command,
    tiny_student_file,
    train_args,
)
from safetensors.torch import load_file
from test_i2v_training import write_pairs

from distill.config.cli import parse_config
from distill.models.lockstep import placeholder_box, placeholder_inputs
from distill.models.student import build_student
from distill.models.student_config import load_student_config
from distill.models.teacher import inspect_teacher
from distill.models.teacher_kind import I2V_A14B, TI2V_5B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError, format_banner
from distill.train.cost import RunCounts, run_cost
from distill.train.plan import estimate, rank_latent_shape, step_activations
from distill.train.sequence_parallel import check_sequence_parallel
from train_distillation import main

CAUSAL = {"student_chunk_frames": 1, "num_frames": 9, "student_init": "teacher", "max_prompts": 4}
# 32x32 pixels, 1 frame: a 4x4 latent in 2x2 patches = 4 tokens, 2 per rank. The tiny teacher has 2
# heads, the tiny student 4: Ulysses gives each rank whole heads.
COMMON = dict(height=32, width=32, num_steps=3, lr=1e-3, log_every=1, batch_size=1)
# method -> its settings, how many transformers a rank splits (the teacher's two experts, the
# student, dmd's critic; a LoRA student is the teacher's experts themselves, split once) and the
# tokens each rank's blocks see.
METHODS = {
    "velocity": ({}, 3, [2]),
    "dmd": ({"method": "dmd"}, 4, [2]),
    "lora": ({"student_lora_rank": 4}, 2, [2]),
    # Experts sharded with FSDP2 over the same two ranks (one context group), the student's blocks
    # recomputed in backward; outputs depend on neither, so its reference is the velocity run's.
    "shard": ({"teacher_placement": "shard", "gradient_checkpointing": True}, 3, [2]),
    # TI2V-5B in image mode: one transformer, a timestep per token (frame 0's tokens at 0), split
    # with the tokens. 5 frames at 32x32 through its 16x VAE: 2 latent frames of one token each.
    "ti2v": ({"num_frames": 5, "guidance_scale": 5.0, "max_prompts": 4}, 2, [1]),
    # The same three methods on the tiny I2V-A14B teacher (the image latents joined to every input's
    # channels) and dmd and a LoRA on TI2V-5B (its one transformer's LoRA: split once): 5 frames at
    # 32x32, 2 latent frames of 4 tokens through the 8x VAE, of 1 through TI2V's 16x one.
    "i2v_velocity": ({"num_frames": 5, "max_prompts": 4}, 3, [4]),
    "i2v_dmd": ({"method": "dmd", "num_frames": 5, "max_prompts": 4}, 4, [4]),
    "i2v_lora": ({"student_lora_rank": 4, "num_frames": 5, "max_prompts": 4}, 2, [4]),
    "ti2v_dmd": ({"method": "dmd", "num_frames": 5, "guidance_scale": 5.0, "max_prompts": 4}, 3, [1]),
    "ti2v_lora": ({"student_lora_rank": 4, "num_frames": 5, "guidance_scale": 5.0, "max_prompts": 4}, 1, [1]),
    # A causal student (the teacher's high-noise expert, chunks of 1 latent frame) on 9-frame clips:
    # 3 latent frames of 4 tokens. ode_init runs it on the whole clip (6 tokens a rank); self_forcing
    # streams 17 frames chunk by chunk on its KV cache (2 a rank), checkpointed, and the teacher and
    # the critic judge a window of the clip's length (6).
    "ode_init": ({**CAUSAL, "method": "ode_init"}, 3, [6]),
    # The same on the tiny image-to-video teacher (the image enters the first chunk's condition).
    "i2v_self_forcing": ({**CAUSAL, "method": "self_forcing", "critic_updates": 2}, 4, [2, 6]),
    "self_forcing": (
        {
            **CAUSAL,
            "method": "self_forcing",
            "critic_updates": 2,
            "rollout_frames": 17,
            "gradient_checkpointing": True,
        },
        4,
        [2, 6],
    ),
    # A causal LoRA student: the teacher's experts, sharded with FSDP2 over the group's two ranks,
    # causal while the student's adapters run and split once; each streams a chunk on its own KV
    # cache of the swapped keys, and answers as the teacher and the critic's adapters over the whole
    # clip. (One process: the experts whole.)
    "lora_self_forcing": (
        {
            **CAUSAL,
            "method": "self_forcing",
            "critic_updates": 2,
            "student_lora_rank": 4,
            "student_init": None,
            "teacher_placement": "shard",
        },
        2,
        [2, 6],
    ),
}
REFERENCE = {"shard": "velocity"}


def ti2v_world(root: Path) -> dict[str, Path]:
    """The tiny TI2V-5B teacher, a student config for its 48 channels, and prompt+image pairs."""
    teacher = write_tiny_teacher(root / "teacher", seed=0, kind=TI2V_5B)
    expert = json.loads((teacher / "transformer" / "config.json").read_text())
    student = json.loads((REPO / "config" / "student_tiny.json").read_text())
    student |= {"in_channels": 48, "out_channels": 48, "text_dim": expert["text_dim"]}
    (root / "student.json").write_text(json.dumps(student))
    return {
        "teacher": teacher,
        "student_config": root / "student.json",
        "data_path": write_pairs(root / "data", size=32),
    }


def i2v_world(root: Path) -> dict[str, Path]:
    """The tiny I2V-A14B teacher, a student config for its 36 input channels, and prompt+image pairs."""
    student = json.loads((REPO / "config" / "student_tiny.json").read_text())
    (root / "student.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "student.json").write_text(json.dumps({**student, "in_channels": 36}))
    return {
        "teacher": write_tiny_teacher(root / "teacher", seed=0, kind=I2V_A14B),
        "student_config": root / "student.json",
        "data_path": write_pairs(root / "data", size=32),
    }


# The runs on another teacher than the tiny T2V one: method -> that world's name in `teachers`.
WORLDS = {
    "ti2v": "ti2v",
    "ti2v_dmd": "ti2v",
    "ti2v_lora": "ti2v",
    "i2v_velocity": "i2v",
    "i2v_dmd": "i2v",
    "i2v_lora": "i2v",
    "i2v_self_forcing": "i2v",
}


def args(teachers: dict[str, Path], out: Path, cache: Path, method: str, **more: object) -> list[str]:
    """The command line of `method`'s run; `teachers`: the tiny T2V teacher ("t2v"), the TI2V and the
    I2V worlds (each run of one of those its own cache: their clips differ in length)."""
    settings = {**COMMON, **METHODS[method][0]}
    teacher = teachers["t2v"]
    if method in WORLDS:
        name = WORLDS[method]
        teacher, cache = teachers[f"{name}_teacher"], cache / method
        settings |= {k: teachers[f"{name}_{k}"] for k in ("student_config", "data_path")}
    if settings.get("student_lora_rank"):  # the student is the teacher's experts: no student config
        settings["student_config"] = None
    return train_args(teacher, out, cache, **settings, **more)


def launch_ranks(runs: list, tmp_path: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """Every run of `runs` (command lines, or {"argv": ..., "fault": ...}) in one torchrun launch of
    `nproc` ranks (tests/sequence_parallel_check.py)."""
    args_file = tmp_path / f"runs-{nproc}.json"
    strings = [
        {**run, "argv": [str(a) for a in run["argv"]]} if isinstance(run, dict) else [str(a) for a in run]
        for run in runs
    ]
    args_file.write_text(json.dumps(strings))
    proc = run_command(
        [
            *WARM_TORCHRUN,
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "sequence_parallel_check.py"),
            str(args_file),
        ],
        env={**__import__("os").environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"},
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metric_rows(out: Path) -> list[dict]:
    """The rows of training steps (a report's row carries its eval/ metrics only)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "skipped_steps" in row]


def trained_weights(out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights after training, the same weights at the start), flattened. A LoRA run: the adapters'
    B matrices, which start at zero."""
    if (out / "lora").is_dir():
        found = {}
        for file in sorted((out / "lora").glob("*lora.safetensors")):  # TI2V's one: lora.safetensors
            found |= {f"{file.name}:{k}": v for k, v in load_file(file).items() if "lora_B" in k}
        after = torch.cat([found[k].float().flatten() for k in sorted(found)])
        return after, torch.zeros_like(after)
    (file,) = (out / "student").glob("*.safetensors")
    weights = load_file(file)
    config = json.loads((out / "student" / "config.json").read_text())
    start = build_student(config, seed=0).state_dict()
    keys = sorted(weights)
    return (
        torch.cat([weights[k].float().flatten() for k in keys]),
        torch.cat([start[k].float().flatten() for k in keys]),
    )


def assert_trained_alike(reference: Path, run: Path, label: str) -> None:
    """`run` logged the same losses and gradient norms at every step as `reference` and ended with the
    same trained weights, within the float noise of another order of reductions."""
    one, two = metric_rows(reference), metric_rows(run)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for ours, theirs in zip(one, two):
        assert ours.keys() == theirs.keys()
        for key, value in ours.items():
            if isinstance(value, float) and key != "steps_per_s":
                # Another order of float reductions (the all-to-alls, the gathered output): 1e-7 to
                # 1e-5 relative, except the TI2V LoRA's, whose loss (~3e-5: the adapters start at zero)
                # is the small difference of two near-equal 48-channel velocities: 1.7e-4 at step 1
                # and 4.9e-4 by step 3 on one CPU model, under 1e-4 on another. A split that went
                # wrong is off by a factor (without the loss scale by the CP degree, half the
                # gradient norm), so 2e-3 still catches it with room for other CPUs' kernels.
                assert theirs[key] == pytest.approx(value, rel=2e-3, abs=1e-6), (label, ours["step"], key)
    # The updates agree: Adam moves a weight whose gradient is ~0 by up to lr on float noise
    # alone, so a handful of elements may differ by that much; the update as a whole agrees. (The
    # LoRA runs train 3,968 adapter values: 5 of them apart by more than 1e-5 is 0.13%.)
    (after_one, start), (after_two, _) = trained_weights(reference), trained_weights(run)
    update, apart = after_one - start, after_two - after_one
    assert update.norm() > 10 * COMMON["lr"], label  # it trained
    assert apart.norm() < 1e-2 * update.norm(), label
    assert (apart.abs() > 1e-5).float().mean() < 3e-3, label


# Runs of two ranks without --sequence_parallel (data parallel, batch 1 each): the references of the
# four-rank runs in context groups of two (test_two_context_groups_of_two_train_like_two_ranks).
DATA_PARALLEL = ("velocity", "lora")
# Samples and the student-vs-teacher report during training, at the last step, for 3 prompts: under
# --sequence_parallel each context group renders its share together (one prompt, or two with a
# repeat that keeps the groups in step), and its first rank writes the files.
MONITORED = dict(save_samples=True, sample_steps=2, sample_interval=3, eval_interval=3, eval_num_buckets=2)
# Seed 1 draws, at each of the 3 steps, a high-noise timestep for one sample of the global batch of 2
# and a low-noise one for the other: each group of the four-rank runs needs the expert it has no
# sample for in the other group's forwards (seed 0 draws low-noise ones only).
GROUPS_SEED = 1


def measured_args(teacher: Path, root: Path, **more: object) -> list[str]:
    """The run whose peak memory a rank measures (test_the_plan_is_within_15_percent_of_a_ranks_peak):
    tests/test_memory_plan.py's 384x384 run (576 tokens, a student of 4 heads x 32 whose activations
    fill the memory, bf16 autocast, gradient checkpointing), on two ranks."""
    return train_args(
        teacher,
        root / "measured",
        root / "measured-cache",
        student_config=tiny_student_file(
            root / "wide_student.json", num_attention_heads=4, attention_head_dim=32, ffn_dim=256
        ),
        height=384,
        width=384,
        max_prompts=2,
        teacher_sample_steps=1,
        batch_size=1,
        num_steps=2,
        gradient_checkpointing=True,
        mixed_precision="bf16",
        **more,
    )


# The causal runs whose peak a rank measures too: the teacher's expert made causal (the shape of the
# tiny teacher's experts, 10 heads of 12), 9-frame clips at 256x256 (3 latent frames of 256 tokens).
CAUSAL_MEASURED = ("ode_init", "self_forcing")


def causal_measured_args(teacher: Path, root: Path, method: str, **more: object) -> list[str]:
    """tests/test_memory_plan.py's causal runs (test_the_plan_of_a_causal_students_step_is_within_15_percent)."""
    return train_args(
        teacher,
        root / f"measured-{method}",
        root / "measured-cache",
        method=method,
        student_config=tiny_student_file(root / "teacher_shape.json", **TEACHER_SHAPE),
        **{**CAUSAL, "max_prompts": 2},
        height=256,
        width=256,
        teacher_sample_steps=1,
        batch_size=1,
        num_steps=3,
        **({"critic_updates": 2} if method == "self_forcing" else {}),
        gradient_checkpointing=True,
        mixed_precision="bf16",
        **more,
    )


def streamed(method: str, monitored: dict) -> dict:
    """The self_forcing runs also stream their samples and report during training (chunk after chunk
    on the KV cache): split, they must show what one process shows."""
    return monitored if method == "self_forcing" else {}


@pytest.fixture(scope="module")
def two_ranks(tiny_teacher, tmp_path_factory) -> tuple[Path, dict[str, Path], subprocess.CompletedProcess]:
    """One two-rank launch of every run the module compares: each method at --sequence_parallel 2,
    the velocity run stopped and resumed, and the data-parallel references. (root, teachers, launch)."""
    root = tmp_path_factory.mktemp("sequence-parallel")
    cache = root / "cache"
    teachers = {
        "t2v": tiny_teacher,
        **{f"ti2v_{k}": v for k, v in ti2v_world(root / "ti2v").items()},
        **{f"i2v_{k}": v for k, v in i2v_world(root / "i2v").items()},
    }
    (root / "sample_prompts.txt").write_text("a red cube\na blue sphere on grass\na green cone at night\n")
    monitored = dict(MONITORED, sample_prompts=root / "sample_prompts.txt")
    runs: list = [
        args(teachers, root / f"{m}-cp2", cache, m, sequence_parallel=2, **streamed(m, monitored))
        for m in METHODS
    ]
    # The velocity run again, stopped by SIGTERM at step 2 and resumed from its checkpoint.
    runs.append(
        {
            "argv": args(teachers, root / "resumed-cp2", cache, "velocity", sequence_parallel=2),
            "fault": "sigterm:2",
        }
    )
    runs += [
        args(
            teachers, root / f"{m}-dp2", cache, m, seed=GROUPS_SEED, **(monitored if m == "velocity" else {})
        )
        for m in DATA_PARALLEL
    ]
    runs.append({"argv": measured_args(tiny_teacher, root, sequence_parallel=2), "measure": True})
    runs += [
        {"argv": causal_measured_args(tiny_teacher, root, m, sequence_parallel=2), "measure": True}
        for m in CAUSAL_MEASURED
    ]
    return root, teachers, launch_ranks(runs, root)


def test_two_ranks_splitting_each_sample_train_like_one_process(two_ranks, capsys):
    """One launch, velocity, dmd and a LoRA student on the T2V and the I2V teacher, velocity with
    sharded experts, velocity, dmd and a LoRA on the TI2V teacher, and the causal methods, each at
    --sequence_parallel 2 with batch 1 (one context group): the same losses and gradient norms
    at every step as one process with batch 1, and the same trained weights. The gradient norm is
    logged after DDP's mean: it matches only if the loss scale puts a group's token shares back
    together into one process's gradient."""
    root, teachers, proc = two_ranks
    assert "1 context group(s) of 2 ranks" in proc.stderr
    for method, (_, models, tokens) in METHODS.items():
        # Each rank's blocks saw half of a sample's tokens: they were split, not merely the result equal.
        for rank in (0, 1):
            assert (
                f"rank {rank} finished {root / f'{method}-cp2'}: 3 steps, split {models} transformer(s), "
                f"their blocks saw sequence lengths {tokens}"
            ) in proc.stdout, proc.stdout
        reference = root / f"{REFERENCE.get(method, method)}-one"
        if method not in REFERENCE:
            monitored = dict(MONITORED, sample_prompts=root / "sample_prompts.txt")
            assert main(args(teachers, reference, root / "cache", method, **streamed(method, monitored))) == 0
            capsys.readouterr()
        assert_trained_alike(reference, root / f"{method}-cp2", method)
    assert_same_samples_and_report(root / "self_forcing-one", root / "self_forcing-cp2")
    assert proc.stderr.count("all 2 ranks hold identical") >= len(METHODS)
    # Resumed under sequence parallel: the same bits as the run that was not stopped.
    resumed = root / "resumed-cp2"
    assert f"rank 1 stopped {resumed} by SIGTERM" in proc.stdout and "resumed from" in proc.stderr
    assert metric_rows(resumed) == [
        {**row, "steps_per_s": other["steps_per_s"]}
        for row, other in zip(metric_rows(root / "velocity-cp2"), metric_rows(resumed))
    ]
    assert torch.equal(trained_weights(resumed)[0], trained_weights(root / "velocity-cp2")[0])


# Four ranks as two context groups of two, against two ranks without --sequence_parallel: name ->
# (settings, the data-parallel run it must equal). Sharded experts (the teacher's, and the LoRA
# student's own) make a group whose samples all fall on one side of the boundary join the other
# group's forwards of the other expert on a placeholder: 2 tokens, one per rank of the group. The
# sharded run samples and evaluates too: each group renders its share of the 3 prompts with the
# sharded teacher (one group repeating a prompt so that both run as many forwards).
GROUPS = {
    "velocity": ({}, "velocity"),
    "shard": ({"teacher_placement": "shard", "monitored": True}, "velocity"),
    "lora-shard": ({"teacher_placement": "shard", "student_lora_rank": 4}, "lora"),
}


def test_two_context_groups_of_two_train_like_two_ranks(two_ranks, tmp_path):
    """DP 2 x CP 2 = DP 2: four ranks with --sequence_parallel 2 (each pair splitting its sample's 4
    tokens) log the same losses and gradient norms and end with the same weights as two ranks
    without it (batch 1 a rank: the same global batch of 2, each group reading what one of the two
    ranks reads), with the teacher whole on every rank, sharded, and sharded under a LoRA student;
    and the sharded run's samples and report during training are the two ranks' (samples under
    --sequence_parallel: one writer per group)."""
    root, teachers, _ = two_ranks
    runs = []
    monitored = dict(MONITORED, sample_prompts=root / "sample_prompts.txt")
    for name, (settings, _) in GROUPS.items():
        method = "lora" if settings.get("student_lora_rank") else "velocity"
        extra = {k: v for k, v in settings.items() if k not in ("student_lora_rank", "monitored")}
        extra |= monitored if settings.get("monitored") else {}
        runs.append(
            args(
                teachers,
                tmp_path / name,
                root / "cache",
                method,
                sequence_parallel=2,
                seed=GROUPS_SEED,
                **extra,
            )
        )
    proc = launch_ranks(runs, tmp_path, nproc=4)
    assert "2 context group(s) of 2 ranks" in proc.stderr
    for name, (_, reference) in GROUPS.items():
        for rank in range(4):
            assert f"rank {rank} finished {tmp_path / name}: 3 steps" in proc.stdout, proc.stdout
            assert "their blocks saw sequence lengths [2]" in proc.stdout
        assert_trained_alike(root / f"{reference}-dp2", tmp_path / name, name)
    # The sharded runs kept their groups in step with placeholders of 2 tokens (1 a rank).
    for name in ("shard", "lora-shard"):
        found = re.findall(
            rf"finished {tmp_path / name}: .* (\d+) placeholder forward\(s\) of (\[.*\]) tokens", proc.stdout
        )
        assert len(found) == 4 and {tokens for n, tokens in found if int(n)} == {"[2]"}, found
    assert proc.stderr.count("all 4 ranks hold identical") == len(GROUPS)
    assert_same_samples_and_report(root / "velocity-dp2", tmp_path / "shard")


def assert_same_samples_and_report(reference: Path, run: Path) -> None:
    """`run` wrote the same files as `reference` under samples/ and eval/ (one writer per context
    group: no file twice, no part left behind), the same teacher references and student samples to
    the pixel (within float noise), and the same report."""
    import imageio.v2 as imageio

    def files(out: Path) -> list[str]:
        return sorted(
            str(f.relative_to(out)) for f in [*(out / "samples").rglob("*"), *(out / "eval").rglob("*")]
        )

    names = files(reference)
    assert names == files(run)
    pictures = [n for n in names if "_prompt_" in n]
    assert len(pictures) == 6  # 3 prompts, teacher and student
    for name in pictures:
        if name.endswith(".png"):
            ours, theirs = (imageio.imread(out / name).astype(int) for out in (reference, run))
            # 8-bit pixels of float outputs that agree to ~1e-6: a rounding step apart at most.
            assert abs(ours - theirs).max() <= 1, name
        else:  # a clip: its frames through the MP4 encoder, which may round a step apart differently
            frames = [np.stack(imageio.mimread(out / name)).astype(float) for out in (reference, run)]
            assert frames[0].shape == frames[1].shape and abs(frames[0] - frames[1]).mean() < 0.5, name
    one, two = (
        json.loads((out / "eval" / "step_00000003" / "eval.json").read_text()) for out in (reference, run)
    )
    for (key, value), (_, other) in zip(flatten(one), flatten(two)):
        if isinstance(value, float) and "seconds" not in key:  # times (and their ratios) vary
            assert other == pytest.approx(value, rel=1e-3, abs=1e-5, nan_ok=True), key
    assert [k for k, _ in flatten(one)] == [k for k, _ in flatten(two)]


def flatten(tree: object, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, leaf) of a JSON tree, in order."""
    if isinstance(tree, dict):
        return [item for key, value in tree.items() for item in flatten(value, f"{prefix}{key}.")]
    if isinstance(tree, list):
        return [item for i, value in enumerate(tree) for item in flatten(value, f"{prefix}{i}.")]
    return [(prefix, tree)]


def test_one_process_is_refused_with_the_launch_that_fixes_it(tiny_teacher, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert main(args({"t2v": tiny_teacher}, tmp_path / "out", cache, "velocity", sequence_parallel=2)) != 0
    err = capsys.readouterr().err
    assert "--sequence_parallel 2 splits each sample over 2 ranks, but this run is one process" in err
    assert "torchrun --nproc_per_node=2 train_distillation.py ... --sequence_parallel 2" in err
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))  # refused before any work


def refusal(cfg, info, heads: dict[str, int], world: int, per_node: int) -> str:
    with pytest.raises(DistillError) as raised:
        check_sequence_parallel(cfg, info, heads, world, per_node, launched=True)
    return format_banner(raised.value)


def test_degrees_a_run_cannot_split_by_are_refused_naming_those_it_can(tiny_teacher, tmp_path):
    info = inspect_teacher(str(tiny_teacher), None, convert_dir=tmp_path / "convert", configs_only=True)

    def config(degree: int, **overrides):
        settings = {**COMMON, "height": 48, **overrides}  # 6x4 latent: 3x2 = 6 tokens
        return parse_config(
            train_args(
                tiny_teacher, tmp_path / "out", tmp_path / "cache", sequence_parallel=degree, **settings
            )
        )

    heads = {"teacher's experts": 2, "student": 4}
    # Not the ranks per node: a context group's all-to-alls stay in a node.
    text = refusal(config(2), info, heads, world=6, per_node=3)
    assert "must divide the ranks per node (3)" in text and "--nproc_per_node=2" in text
    text = refusal(config(4), info, heads, world=8, per_node=8)
    assert "does not divide the 2 attention heads of the teacher's experts" in text
    assert "--sequence_parallel 1, 2 (the degrees this run can use)" in text
    text = refusal(config(4), info, {"student": 8}, world=8, per_node=8)
    assert "does not divide the 6 tokens of a sample (--height 48 --width 32 --num_frames 1)" in text
    # A causal student streams one chunk a forward: the chunk's tokens must split (9 frames are 3
    # latent frames of 6 tokens; the clip's 18 split 9 ways, a chunk of one frame does not).
    causal = dict(CAUSAL, method="ode_init")
    text = refusal(config(9, **causal), info, {"student": 9}, world=9, per_node=9)
    assert "does not divide the 6 tokens of a chunk of --student_chunk_frames 1 latent frame(s)" in text
    assert "or a --height, --width or --student_chunk_frames whose token count N divides" in text
    whole_clip = config(9, **dict(causal, student_chunk_frames=3))
    check_sequence_parallel(whole_clip, info, {"student": 9}, 9, 9, launched=True)
    # Samples and evaluations during training run with it (each context group renders together).
    check_sequence_parallel(config(2, save_samples=True, eval_interval=2), info, heads, 2, 2, launched=True)
    # The degrees named are accepted; 1 is never refused.
    check_sequence_parallel(config(2), info, heads, 8, 8, launched=True)
    check_sequence_parallel(config(1), info, heads, 1, 1, launched=False)


def test_the_plan_gives_each_rank_its_share_of_the_activations(tiny_teacher, tmp_path, capsys):
    info = inspect_teacher(str(tiny_teacher), None, convert_dir=tmp_path / "convert", configs_only=True)
    student = load_student_config(REPO / "config" / "student_tiny.json", info.expert_config)

    def config(degree: int, **overrides):
        argv = args(
            {"t2v": tiny_teacher}, tmp_path / "out", tmp_path / "cache", "velocity", sequence_parallel=degree
        )
        return parse_config(argv + [f"--{k}={v}" for k, v in overrides.items()])

    # A rank of a context group of 2 is planned as the model at half the tokens (32x32 pixels: 4; 16x32:
    # 2) with the whole text: more than half of the whole sample's peak, whose text part stays whole.
    def peak(degree: int, **overrides) -> float:
        return step_activations(config(degree, **overrides), info, student, None, torch.float32).bytes

    assert peak(2) == peak(1, height=16)
    assert peak(1) / 2 < peak(2) < peak(1)
    # With accumulation the gradients are held through the update, whole on every rank.
    held = 4.0 * sum(p.numel() for p in build_student(student).parameters())
    assert peak(2, gradient_accumulation_steps=2) == peak(1, height=16, gradient_accumulation_steps=2) > held
    # The share of the tokens one rank computes on: what the degree divides of frames, rows, columns.
    assert rank_latent_shape((16, 21, 90, 160), (1, 2, 2), 8) == (16, 21, 90, 20)
    assert rank_latent_shape((16, 4, 6, 10), (1, 2, 2), 6) == (16, 2, 2, 10)  # 2 frames x 1 x 5 = 60 / 6
    # Four ranks in context groups of 2 train the samples of two ranks: the same FLOPs.
    counts = RunCounts(8, 8, 0, 0)
    four = run_cost(config(2), info, student, None, counts, world_size=4).flops["training"]
    assert four == run_cost(config(1), info, student, None, counts, world_size=2).flops["training"]
    # The dry run (planning for 4 ranks without them) accepts the degree and says so.
    argv = args({"t2v": tiny_teacher}, tmp_path / "dry", tmp_path / "cache", "velocity", sequence_parallel=2)
    assert main([*argv, "--dry_run", "--plan_world_size", "4"]) == 0
    assert "each rank computing on 1/2 of them (--sequence_parallel)" in capsys.readouterr().out
    # Without the world size to plan for, a dry run in one process is told to give it.
    assert main([*argv, "--dry_run"]) != 0
    assert "--dry_run --plan_world_size 8" in capsys.readouterr().err


def test_the_plan_is_within_15_percent_of_a_ranks_peak(two_ranks, tiny_teacher):
    """The plan of a rank of a context group of 2 against the peak of live tensors each rank measured
    over its real training steps (tests/test_memory_plan.py holds one process, --sequence_parallel 1,
    to the same 15% at this size). Its total (the measured window sees DDP rebuild its gradient buckets
    after the first step: the plan's bucket row), and its gradients and activations alone (the peak
    less the weights, AdamW and buckets the plan counts from the configs), which the total's held
    bytes would otherwise hide: planned as half of a whole sample's, they were 25% short."""
    root, _, proc = two_ranks
    assert_plan_within_15_percent(proc, root, measured_args(tiny_teacher, root, sequence_parallel=2))


@pytest.mark.parametrize("method", CAUSAL_MEASURED)
def test_the_plan_of_a_causal_run_is_within_15_percent_of_a_ranks_peak(two_ranks, tiny_teacher, method):
    """The same for a causal student: ode_init's forward with a timestep per token, self_forcing's
    rollout of one chunk a forward (each split over the group) and the scores over its exit steps."""
    root, _, proc = two_ranks
    argv = causal_measured_args(tiny_teacher, root, method, sequence_parallel=2)
    assert_plan_within_15_percent(proc, root, argv)


def assert_plan_within_15_percent(proc: subprocess.CompletedProcess, root: Path, argv: list[str]) -> None:
    """The plan of `argv`'s run at --sequence_parallel 2, total and activations, against the one peak
    both ranks of the launch measured for it."""
    cfg = parse_config(argv)
    found = re.findall(rf"measured {re.escape(str(cfg.output_dir))}: peak (\d+) bytes", proc.stdout)
    peaks = {int(p) for p in found}
    assert len(found) == 2 and len(peaks) == 1, proc.stdout  # both ranks hold the same: one number
    (peak,) = peaks
    info = inspect_teacher(cfg.teacher_path, None, convert_dir=root / "convert", configs_only=True)
    student = load_student_config(cfg.student_config, info.expert_config)
    critic = student if cfg.trains_critic else None
    plan = estimate(cfg, info, student, torch.device("cpu"), "gpu", 2, critic)
    assert plan.total == pytest.approx(peak, rel=0.15), (
        f"plan {plan.total / 2**20:.2f} MiB, measured {peak / 2**20:.2f}"
    )
    held = plan.total - plan.activations
    assert plan.activations == pytest.approx(peak - held, rel=0.15), (
        f"plan {plan.activations / 2**20:.2f} MiB, measured {(peak - held) / 2**20:.2f}"
    )


def test_a_placeholder_is_the_fewest_patches_a_context_group_splits():
    """A group with no sample for a sharded expert joins its forwards on the fewest patches whose count
    the degree divides, from the first patch on: one patch unsplit, N of one row when it is that wide,
    else a box of rows (or frames) as well."""
    assert placeholder_box((21, 45, 80), 1) == (1, 1, 1)
    assert placeholder_box((21, 45, 80), 8) == (1, 1, 8)
    assert placeholder_box((3, 2, 3), 4) == (1, 2, 2)  # rows of 3: two rows of 2
    assert placeholder_box((4, 1, 1), 4) == (4, 1, 1)  # one patch a frame: four frames
    x = torch.randn(2, 36, 3, 4, 6)  # 3 frames of 2 x 3 patches (1x2x2), I2V's 36 channels
    box, t, text = placeholder_inputs(x, torch.tensor([900, 10]), torch.randn(2, 7, 32), (1, 2, 2), 2)
    assert torch.equal(box, x[:1, :, :1, :2, :4]) and t.tolist() == [900] and text.shape == (1, 1, 32)
    with pytest.raises(ValueError):
        placeholder_box((3, 1, 1), 4)  # 3 patches: never a sample a degree of 4 was accepted for
