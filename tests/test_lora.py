"""LoRA students: the teacher's own experts with adapters, one copy of the base weights for every
role, exported in diffusers' and Wan's key formats that stock loaders read as trained."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import A14B_EXPERT, REPO, preempt_then_finish, train_args
from safetensors.torch import load_file
from test_distributed import assert_same_trajectory, launch

from distill.config.cli import parse_config
from distill.models.lora import (
    CRITIC_ADAPTER,
    EXPERTS,
    STUDENT_ADAPTER,
    LoraExperts,
    LoraShape,
    count_adapter_parameters,
)
from distill.models.lora_files import (
    FILES,
    WAN_FORMAT_DIR,
    wan_format_problem,
    write_lora_folder,
)
from distill.models.lora_folder import read_lora_folder
from distill.models.teacher import inspect_teacher
from distill.models.tiny import build_tiny_pipeline
from distill.sample.student_folder import load_lora_student, load_merged_student
from distill.train.trainer import Distiller
from train_distillation import main

pytestmark = pytest.mark.long  # a minute or more in all: scheduled first (conftest.py)

BOUNDARY = 0.875


def tiny_experts(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    pipe = build_tiny_pipeline(seed=seed)
    return pipe.transformer, pipe.transformer_2


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Four samples, two on each side of the boundary (900 and 950 go to the high-noise expert)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(4, 16, 1, 4, 4, generator=gen),
        "timestep": torch.tensor([900.0, 100.0, 950.0, 300.0]),
        "encoder_hidden_states": torch.randn(4, 8, 32, generator=gen),
    }


def expert_outputs(high, low, inputs) -> torch.Tensor:
    """What the two experts give, each on its own samples, in batch order."""
    rows = {"high": [0, 2], "low": [1, 3]}
    out = torch.empty_like(inputs["hidden_states"])
    for expert, index in ((high, rows["high"]), (low, rows["low"])):
        part = {k: v[index] for k, v in inputs.items()}
        out[index] = expert(**part, return_dict=False)[0]
    return out


def perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def lora_run(high, low, critic: bool = True) -> LoraExperts:
    return LoraExperts(high, low, LoraShape(4, 8.0), LoraShape(4, 4.0) if critic else None, seed=0)


def test_a_fresh_student_is_the_teacher_and_training_it_leaves_the_teacher_alone():
    high, low = tiny_experts()
    inputs = batch()
    with torch.no_grad():
        before = expert_outputs(high, low, inputs)
    lora = lora_run(high, low)
    student = lora.model(STUDENT_ADAPTER, BOUNDARY)
    teacher_high, teacher_low = lora.teacher_views()
    with torch.no_grad():
        torch.testing.assert_close(student(**inputs)[0], before, rtol=0, atol=1e-5)  # LoRA B starts at 0
        perturb(student, seed=1)
        moved = student(**inputs)[0]
        assert (moved - before).abs().max() > 1e-3
        torch.testing.assert_close(
            expert_outputs(teacher_high, teacher_low, inputs), before, rtol=0, atol=1e-5
        )
        # the critic's adapters are its own: still the teacher's outputs
        torch.testing.assert_close(
            lora.model(CRITIC_ADAPTER, BOUNDARY)(**inputs)[0], before, rtol=0, atol=1e-5
        )
    # only adapters are trained, and nothing of the base weights is a parameter of the student
    names = dict(student.named_parameters())
    assert names and all("lora_" in n for n in names)
    assert sum(p.numel() for p in student.parameters()) == 2 * count_adapter_parameters(
        dict(high.config), LoraShape(4, 8.0)
    )


def test_gradients_are_right_when_other_roles_run_the_experts_between_forward_and_backward():
    high, low = tiny_experts()
    lora = lora_run(high, low)
    student, critic = lora.model(STUDENT_ADAPTER, BOUNDARY), lora.model(CRITIC_ADAPTER, BOUNDARY)
    teacher_high, teacher_low = lora.teacher_views()
    perturb(student, seed=1)
    perturb(critic, seed=2)
    student.enable_gradient_checkpointing()  # backward recomputes the blocks with whatever adapter is on
    inputs = batch()

    def grads(interleave: bool) -> list[torch.Tensor]:
        student.zero_grad(set_to_none=True)
        loss = student(**inputs)[0].pow(2).mean()
        if interleave:  # as dmd does: teacher and critic between the student's forward and backward
            with torch.no_grad():
                expert_outputs(teacher_high, teacher_low, inputs)
                critic(**inputs)
        loss.backward()
        return [p.grad.clone() for p in student.parameters()]

    alone, interleaved = grads(False), grads(True)
    # the teacher's turn (adapters off) froze nothing this run trains; an untrained adapter stays frozen
    with torch.no_grad():
        expert_outputs(teacher_high, teacher_low, inputs)
    assert all(p.requires_grad for p in [*student.parameters(), *critic.parameters()])
    assert all(g.abs().sum() > 0 for g in alone)
    for a, b in zip(alone, interleaved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(p.grad is None for p in critic.parameters())


def test_exported_adapters_load_into_stock_diffusers_and_the_wan_format_reads_back(tmp_path):
    high, low = tiny_experts()
    lora = lora_run(high, low, critic=False)
    student = lora.model(STUDENT_ADAPTER, BOUNDARY)
    perturb(student, seed=1)
    shape = LoraShape(4, 8.0)  # alpha != rank: the strength must travel with the files
    folder = write_lora_folder({w: student.state(w) for w in EXPERTS}, shape, tmp_path / "lora")
    umask = os.umask(0)
    os.umask(umask)
    for path in (folder / FILES["high"], folder / WAN_FORMAT_DIR / FILES["low"]):  # readable as any export
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    inputs = batch()
    with torch.no_grad():
        expected = student(**inputs)[0]
    # the model card's calls: one adapter per expert, low-noise into transformer_2
    pipe = build_tiny_pipeline(seed=0)
    pipe.load_lora_weights(str(folder), weight_name=FILES["high"], adapter_name="fast")
    pipe.load_lora_weights(
        str(folder), weight_name=FILES["low"], adapter_name="fast_2", load_into_transformer_2=True
    )
    with torch.no_grad():
        torch.testing.assert_close(
            expert_outputs(pipe.transformer, pipe.transformer_2, inputs), expected, rtol=0, atol=1e-5
        )
    # Wan key names with an alpha for every module, as ComfyUI and Lightning-style files have
    wan = load_file(str(folder / WAN_FORMAT_DIR / FILES["high"]))
    downs = [k for k in wan if k.endswith(".lora_down.weight")]
    assert downs and all(k.startswith("diffusion_model.blocks.") for k in wan)
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in wan
    assert "diffusion_model.blocks.0.ffn.0.lora_up.weight" in wan
    assert all(wan[k.replace(".lora_down.weight", ".alpha")].item() == 8.0 for k in downs)
    pipe = build_tiny_pipeline(seed=0)
    pipe.load_lora_weights(str(folder / WAN_FORMAT_DIR), weight_name=FILES["high"], adapter_name="w")
    pipe.load_lora_weights(
        str(folder / WAN_FORMAT_DIR),
        weight_name=FILES["low"],
        adapter_name="w_2",
        load_into_transformer_2=True,
    )
    with torch.no_grad():
        torch.testing.assert_close(
            expert_outputs(pipe.transformer, pipe.transformer_2, inputs), expected, rtol=0, atol=1e-5
        )
    shape_back, states = read_lora_folder(folder)
    assert shape_back == shape and states["high"].keys() == student.state("high").keys()
    # the check itself: a wrong alpha is caught
    state = student.state("high")
    broken = dict(wan)
    broken["diffusion_model.blocks.0.self_attn.q.alpha"] = torch.tensor(4.0)
    assert wan_format_problem(state, shape, wan) is None
    assert "blocks.0.attn1.to_q" in wan_format_problem(state, shape, broken)


def test_the_plan_counts_adapters_as_published_for_a14b():
    a14b = {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40}
    # rank 64 on all ten linears of a block: ~307M per expert (the figure published recipes quote)
    assert count_adapter_parameters(a14b, LoraShape(64, 64.0)) == pytest.approx(307e6, rel=0.01)


def lora_args(teacher, out, cache, **overrides):
    settings = dict(
        method="dmd",
        student_config=None,
        student_init=None,
        student_lora_rank=4,
        height=32,
        width=32,
        num_steps=5,
        critic_updates=2,
        lr=1e-3,
        critic_lr=1e-3,
    )
    settings.update(overrides)
    return train_args(teacher, out, cache, **settings)


def run(args):
    return Distiller(parse_config(args)).run()


def adapters(folder) -> dict[str, torch.Tensor]:
    return {f"{w}.{k}": v for w, state in read_lora_folder(folder)[1].items() for k, v in state.items()}


def test_a_lora_dmd_run_resumes_exactly_and_exports_what_its_model_card_loads(
    tiny_teacher, tmp_path, monkeypatch, capsys
):
    common = dict(checkpoint_every=2, ema_decay=0.9)
    cache = tmp_path / "cache"
    straight = run(lora_args(tiny_teacher, tmp_path / "straight", cache, **common))
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "exception:4")
    with pytest.raises(RuntimeError, match="injected exception at step 4"):
        run(lora_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    resumed = run(lora_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    assert resumed.resumed_from.name == "step_00000002"
    assert straight.student_dir.name == "lora" and straight.ema_dir.name == "lora_ema"
    for a, b in ((straight.student_dir, resumed.student_dir), (straight.ema_dir, resumed.ema_dir)):
        x, y = adapters(a), adapters(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # the checkpoint holds adapters only, never the experts' base weights
    checkpoint = sorted((straight.output_dir / "checkpoints").iterdir())[-1]
    saved = load_file(str(checkpoint / "student.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    assert all("lora_" in k for k in load_file(str(checkpoint / "critic.safetensors")))
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["identity"]["lora"] == {
        "rank": 4,
        "alpha": 4.0,
        "targets": list(LoraShape(4, 4.0).targets),
        "critic_rank": 4,
    }
    # the export: scheduler, run settings and a card whose code loads the adapters into the teacher
    lora_dir = straight.student_dir
    assert (lora_dir / "scheduler_config.json").is_file() and (
        lora_dir / WAN_FORMAT_DIR / FILES["low"]
    ).is_file()
    settings = json.loads((lora_dir / "run_settings.json").read_text())
    assert settings["num_inference_steps"] == 4 and settings["guidance_scale"] == 1.0
    card = (lora_dir / "README.md").read_text()
    assert "load_into_transformer_2=True" in card and "comfyui/" in card
    # a changed rank is another run: the resume is refused, naming what changed
    other = lora_args(tiny_teacher, tmp_path / "resumed", cache, student_lora_rank=8, **common)
    capsys.readouterr()
    assert main(other) == 9
    assert "made with a different lora" in capsys.readouterr().err


def test_a_preempted_lora_run_under_bf16_autocast_resumes_to_the_same_adapters(
    tiny_teacher, tmp_path, monkeypatch, capsys
):
    """SIGTERM mid-run (a preemption): exit 75 with a checkpoint at that step and no export; the rerun
    ends with the adapters of an uninterrupted run, bit for bit (the same code path replayed), with
    the student and the critic under bf16 autocast."""
    common = dict(num_steps=5, checkpoint_every=100, mixed_precision="bf16", ema_decay=0.9)
    cache = tmp_path / "cache"
    assert main(lora_args(tiny_teacher, tmp_path / "straight", cache, **common)) == 0
    out = tmp_path / "preempted"

    def stopped_at_step_3() -> None:
        assert "stopped by SIGTERM at step 3" in capsys.readouterr().out
        assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")] == [
            "step_00000003"
        ]
        assert not (out / "lora").exists()

    preempt_then_finish(
        main, lora_args(tiny_teacher, out, cache, **common), monkeypatch, capsys, 3, stopped_at_step_3
    )
    for folder in ("lora", "lora_ema"):
        x, y = adapters(tmp_path / "straight" / folder), adapters(out / folder)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), folder


def test_the_card_generate_and_evaluate_take_a_lora_folder(tiny_teacher, tmp_path, monkeypatch):
    import re

    from diffusers import WanPipeline
    from PIL import Image

    from distill import evaluate, generate

    result = run(
        lora_args(
            tiny_teacher, tmp_path / "out", tmp_path / "cache", num_steps=2, export_formats="diffusers,merged"
        )
    )
    for name in ("transformer", "transformer_2"):  # --export_formats merged: standalone experts too
        assert (result.output_dir / "merged" / name / "config.json").is_file()
    # the model card's code runs as written: stock WanPipeline, load_lora_weights twice, its scheduler
    monkeypatch.chdir(tmp_path)
    card = (result.student_dir / "README.md").read_text()
    exec(re.search(r"```python\n(.*?)```", card, re.S).group(1), {"__name__": "card"})
    assert Image.open(tmp_path / "sample.png").size == (32, 32)
    image = tmp_path / "fox.png"
    assert (
        generate.main(["--student", str(result.student_dir), "--prompt", "a red fox", "--output", str(image)])
        == 0
    )
    assert image.is_file()
    out = tmp_path / "eval"
    argv = ["--student", str(result.student_dir), "--prompts", str(REPO / "data" / "static_prompts.txt")]
    assert evaluate.main([*argv, "--output_dir", str(out), "--max_prompts", "2", "--num_buckets", "2"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["cost"]["student"]["forwards_per_sample"] == 4  # K steps, one forward each
    teacher = report["cost"]["teacher"]  # the same experts with adapters off: two forwards per step (CFG)
    assert teacher["forwards_per_sample"] == 2 * teacher["steps"]

    # merged/ is the same student as standalone experts: generate and evaluate take it as they take lora/.
    merged = result.output_dir / "merged"
    info = inspect_teacher(str(tiny_teacher))
    cpu = torch.device("cpu")
    as_lora, teacher_high, _ = load_lora_student(result.student_dir, info, cpu, torch.float32)
    as_merged = load_merged_student(merged, info, cpu, torch.float32)
    generator = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 16, 1, 4, 4, generator=generator), torch.randn(1, 8, 32, generator=generator)
    with torch.no_grad():
        ours, theirs, bare = (
            model(
                hidden_states=x, timestep=torch.tensor([950.0]), encoder_hidden_states=text, return_dict=False
            )[0]
            for model in (as_lora, as_merged, teacher_high)
        )
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)  # measured: 5e-7 apart
    assert float((ours - bare).abs().max()) > 1e-3  # the trained adapters, not the teacher (0.016)
    # ... and a folder stock WanPipeline loads as it is: those experts, the teacher's boundary, the run's sampler.
    stock = WanPipeline.from_pretrained(str(merged))
    assert stock.config.boundary_ratio == info.boundary_ratio
    for loaded, expert in ((stock.transformer, as_merged.high), (stock.transformer_2, as_merged.low)):
        state = expert.state_dict()
        assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    sampler = json.loads((result.student_dir / "scheduler_config.json").read_text())
    assert type(stock.scheduler).__name__ == sampler["_class_name"]
    assert stock.scheduler.config.shift == sampler["shift"]
    # Its card's code runs as written and draws what the lora/ card's code drew.
    drawn_with_adapters = np.asarray(Image.open(tmp_path / "sample.png"), dtype=np.int16)
    card = (merged / "README.md").read_text()
    assert "adapters merged into both experts" in card and "WanPipeline.from_pretrained" in card
    exec(re.search(r"```python\n(.*?)```", card, re.S).group(1), {"__name__": "card"})
    drawn_merged = np.asarray(Image.open(tmp_path / "sample.png"), dtype=np.int16)
    assert np.abs(drawn_merged - drawn_with_adapters).max() <= 1
    merged_image = tmp_path / "fox_merged.png"
    assert (
        generate.main(["--student", str(merged), "--prompt", "a red fox", "--output", str(merged_image)]) == 0
    )
    ours, theirs = (np.asarray(Image.open(p), dtype=np.int16) for p in (image, merged_image))
    assert np.abs(ours - theirs).max() <= 1  # W + BA against W x + B A x: rounding apart
    argv[1] = str(merged)
    out = tmp_path / "eval_merged"
    assert evaluate.main([*argv, "--output_dir", str(out), "--max_prompts", "2", "--num_buckets", "2"]) == 0
    again = json.loads((out / "eval.json").read_text())
    assert again["denoiser"]["mse"] == pytest.approx(report["denoiser"]["mse"], rel=1e-3)
    assert again["sampler"]["latent_mse"] == pytest.approx(report["sampler"]["latent_mse"], rel=1e-3)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        ({"student_config": str(REPO / "config" / "student_tiny.json")}, "--student_config"),
        ({"student_init": "teacher"}, "--student_init"),
        ({"export_formats": "diffusers,original"}, "--export_formats"),
        ({"teacher_placement": "cpu"}, "--teacher_placement"),
        ({"student_lora_targets": "to_q,proj_out"}, "--student_lora_targets"),
        ({"method": "velocity", "critic_lora_rank": 4}, "--critic_lora_rank"),
    ],
)
def test_settings_a_lora_student_cannot_have_are_refused_naming_the_flag(
    tiny_teacher, tmp_path, capsys, extra, flag
):
    code = main(lora_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", **extra))
    err = capsys.readouterr().err
    assert code == 3 and "ERROR (config)" in err and flag in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_lora_run_under_torchrun_matches_one_process_whole_or_sharded_and_merges_them(
    tiny_teacher, tmp_path
):
    """Two ranks with whole experts (DDP: only adapter gradients reduced, replicas that agree at the end)
    train as one process on the same global batch; with the experts sharded (FSDP2 holds 1/2 of each
    expert's frozen weights per rank; the adapters stay whole and DDP-reduced) as with whole ones. One
    sample per rank, so steps where the ranks' samples fall on different sides of the boundary make a
    rank run an expert on a placeholder (and back-propagate through it) to keep the gathers in step;
    gradient checkpointing recomputes sharded blocks in backward."""
    from diffusers import WanTransformer3DModel

    from distill.models.lora_files import write_merged_experts

    # Seed 2: the ranks' critic samples fall on different sides of the boundary in several updates
    # (6 placeholder forwards with gradient, counted when this test was written).
    common = dict(batch_size=1, num_steps=4, gradient_checkpointing=True, seed=2)
    for placement in ("shard", "gpu"):
        args = lora_args(
            tiny_teacher, tmp_path / placement, tmp_path / "cache", teacher_placement=placement, **common
        )
        if placement == "shard":
            args += ["--export_formats", "diffusers,merged"]
        stderr = launch(args, nproc=2).stderr
        assert f"teacher placement: {placement}" in stderr
        assert "all 2 ranks hold identical student and critic weights" in stderr
    one = {**common, "batch_size": 2}  # the same global batch in one process
    assert main(lora_args(tiny_teacher, tmp_path / "one", tmp_path / "cache", **one)) == 0
    keys = ("loss", "grad_norm", "critic_loss", "critic_grad_norm")
    # Equal losses and gradient norms per step (weights after Adam are not compared: see
    # assert_same_trajectory). A LoRA loss starts as a small difference of near-equal velocities (the
    # adapters at zero), which magnifies another order of reductions: step 1's loss used a third of
    # 1e-5 on one CPU, and another CPU model moved such a loss up to 5x more (test_sequence_parallel).
    # Ranks that did not share their gradients, or read other samples, are off by far more.
    assert_same_trajectory([tmp_path / "one", tmp_path / "gpu"], first_rtol=1e-4, rtol=1e-3, keys=keys)
    assert (tmp_path / "gpu" / "lora" / FILES["high"]).is_file()
    # Gathered weights are exact; placeholders and the gathers reorder some float sums (1e-5 seen).
    assert_same_trajectory([tmp_path / "shard", tmp_path / "gpu"], first_rtol=1e-4, rtol=1e-3, keys=keys)
    # merged/ gathered from the shards = the whole teacher's experts with the run's own lora/ added in.
    shape, states = read_lora_folder(tmp_path / "shard" / "lora")
    high, low = (
        WanTransformer3DModel.from_pretrained(tiny_teacher / name)
        for name in ("transformer", "transformer_2")
    )
    experts = LoraExperts(high, low, shape, None, seed=0)
    experts.load(STUDENT_ADAPTER, states)
    expected = write_merged_experts({"high": high, "low": low}, STUDENT_ADAPTER, tmp_path / "expected")
    for name in ("transformer", "transformer_2"):
        ours = WanTransformer3DModel.from_pretrained(tmp_path / "shard" / "merged" / name).state_dict()
        theirs = WanTransformer3DModel.from_pretrained(expected / name).state_dict()
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        ({"critic_lora_rank": 0, "teacher_placement": "shard"}, "--critic_lora_rank"),
        ({"teacher_placement": "cpu"}, "--teacher_placement"),
    ],
)
def test_placements_a_lora_run_cannot_use_are_refused_with_the_way_out(
    tiny_teacher, tmp_path, capsys, extra, flag
):
    code = main(lora_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", **extra))
    err = capsys.readouterr().err
    assert code == 3 and flag in err and "Traceback" not in err
    assert "--teacher_placement gpu" in err
    assert not (tmp_path / "out").exists()


def test_lora_dmd_defaults_to_adapter_rates_and_a_full_critic_keeps_dmds_own(tiny_teacher, tmp_path):
    def rates(**extra):
        args = lora_args(
            tiny_teacher, tmp_path / "o", tmp_path / "c", **{"lr": None, "critic_lr": None, **extra}
        )
        cfg = parse_config(args)
        return cfg.lr, cfg.critic_lr, cfg.lr_scheduler

    assert rates() == (1e-4, 1e-4, "constant")
    assert rates(critic_lora_rank=0) == (1e-4, 4e-7, "constant")
    assert rates(lr=5e-4) == (5e-4, 1e-4, "constant")  # what the user gives wins


def test_merged_experts_are_standalone_models_that_sample_as_the_adapters_do(tmp_path):
    from diffusers import WanTransformer3DModel

    from distill.models.lora_files import write_merged_experts

    high, low = tiny_experts()
    student = lora_run(high, low, critic=False).model(STUDENT_ADAPTER, BOUNDARY)
    perturb(student, seed=4)
    inputs = batch()
    with torch.no_grad():
        expected = student(**inputs)[0]
    folder = write_merged_experts(
        {w: student.expert(w) for w in EXPERTS}, STUDENT_ADAPTER, tmp_path / "merged"
    )
    merged = [
        WanTransformer3DModel.from_pretrained(folder / name) for name in ("transformer", "transformer_2")
    ]
    assert not any("lora" in k for k in merged[0].state_dict())
    with torch.no_grad():
        torch.testing.assert_close(expert_outputs(*merged, inputs), expected, rtol=1e-4, atol=1e-5)


def test_one_expert_at_a_time_trains_only_that_experts_adapter_and_the_low_phase_starts_from_the_high(
    tiny_teacher, tmp_path
):
    cache = tmp_path / "cache"
    high = run(lora_args(tiny_teacher, tmp_path / "high", cache, expert_phase="high", num_steps=3))
    fresh = run(lora_args(tiny_teacher, tmp_path / "fresh", cache, num_steps=1, lr=1e-30, critic_lr=1e-30))
    first, untouched = adapters(high.student_dir), adapters(fresh.student_dir)
    moved = {
        w: any(not torch.equal(first[k], untouched[k]) for k in first if k.startswith(w)) for w in EXPERTS
    }
    assert moved == {"high": True, "low": False}
    low = run(
        lora_args(
            tiny_teacher,
            tmp_path / "low",
            cache,
            expert_phase="low",
            student_lora_init=high.student_dir,
            num_steps=3,
        )
    )
    second = adapters(low.student_dir)
    assert all(torch.equal(second[k], first[k]) for k in first if k.startswith("high."))  # kept frozen
    assert any(not torch.equal(second[k], first[k]) for k in first if k.startswith("low."))
    # What each export says it is: the phase in its run settings, the expert it trained on its card.
    for result, phase in ((high, "high"), (low, "low"), (fresh, None)):
        settings = json.loads((result.student_dir / "run_settings.json").read_text())
        assert settings.get("expert_phase") == phase
        card = (result.student_dir / "README.md").read_text()
        trained = [f"of the {w}-noise expert's adapters only" in card for w in ("high", "low")]
        assert trained == [phase == "high", phase == "low"]


@pytest.mark.parametrize(
    ("extra", "fix"),
    [
        ({"expert_phase": "low"}, "run --expert_phase high first"),
        ({"expert_phase": "high", "method": "velocity", "critic_lora_rank": None}, "use --method dmd"),
        ({"student_lora_init": "nowhere"}, "holds no LoRA adapters"),
    ],
)
def test_phase_settings_that_cannot_work_are_refused_with_the_way_out(
    tiny_teacher, tmp_path, capsys, extra, fix
):
    code = main(lora_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", **extra))
    err = capsys.readouterr().err
    assert code == 3 and fix in err and "Traceback" not in err


def test_the_memory_plan_holds_the_experts_once_and_counts_what_each_phase_trains(tmp_path):
    from pathlib import Path

    from distill.models.teacher import TeacherInfo
    from distill.train.plan import estimate, memory_plan

    a14b = A14B_EXPERT
    info = TeacherInfo(Path("A14B"), 0.875, 3.0, a14b, 8, 4)
    cpu, gib = torch.device("cpu"), 2**30

    def plan(**extra):
        argv = lora_args(
            Path("t"), Path("o"), Path("c"), student_lora_rank=64, teacher_dtype="bfloat16", **extra
        )
        cfg = parse_config([*argv, "--height", "480", "--width", "832", "--gradient_checkpointing"])
        return cfg, estimate(cfg, info, a14b, cpu, "gpu", 1, a14b)

    cfg, both = plan()
    _, high = plan(expert_phase="high")
    adapters_one_expert = 12 * 307e6  # fp32 weights, two AdamW moments (gradients: in the step's peak)
    assert both.teacher / gib == pytest.approx(53.3, abs=0.5)  # the two experts, once, in bf16
    assert both.student == pytest.approx(2 * adapters_one_expert, rel=0.01) and both.critic == pytest.approx(
        both.student
    )
    assert high.student == pytest.approx(both.student / 2) and high.teacher == both.teacher
    text = memory_plan(cfg, info, a14b, cpu, critic_config=a14b)
    assert "LoRA rank 64" in text and "held once" in text and "LoRA rank 64 on the same experts" in text
    # Sharded over 8 GPUs each holds 1/8 of the experts (plus one gathered block of each) and the
    # whole adapters: both experts' adapters and a LoRA critic then fit an 80 GB GPU.
    sharded = estimate(cfg, info, a14b, cpu, "shard", 8, a14b)
    assert sharded.teacher / gib == pytest.approx(53.3 / 8 + 2 * 53.3 / 2 / 40, abs=0.1)
    # (DDP's gradient buckets of both adapter sets, 4.6 GiB, come with the 8 ranks)
    assert sharded.student == both.student and sharded.total < both.total - 40 * gib
    eight = memory_plan(cfg, info, a14b, cpu, world_size=8, critic_config=a14b)
    verdict = eight.splitlines()[-1]
    assert "shard yes" in verdict and "cpu" not in verdict  # a LoRA run never streams its experts


def test_a_rank_above_what_the_layers_hold_is_refused_before_anything_is_written(
    tiny_teacher, tmp_path, capsys
):
    # the tiny experts are 24 wide
    code = main(lora_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", student_lora_rank=32))
    err = capsys.readouterr().err
    assert code == 3 and "--student_lora_rank 32 is larger than the teacher's layers allow (24)" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_lora_run_and_a_full_student_run_never_resume_each_other(tiny_teacher, tmp_path, capsys):
    full = train_args(tiny_teacher, tmp_path / "full", tmp_path / "cache", method="dmd", height=32, width=32)
    lora_into_full = lora_args(tiny_teacher, tmp_path / "full", tmp_path / "cache")
    lora = lora_args(tiny_teacher, tmp_path / "lora", tmp_path / "cache", num_steps=2)
    full_into_lora = train_args(
        tiny_teacher, tmp_path / "lora", tmp_path / "cache", method="dmd", height=32, width=32
    )
    for first, second in ((full, lora_into_full), (lora, full_into_lora)):
        assert main([*first, "--checkpoint_every", "1", "--num_steps", "2"]) == 0
        out = Path(first[first.index("--output_dir") + 1])
        kept = sorted(p.name for p in (out / "checkpoints").iterdir())
        capsys.readouterr()
        assert main([*second, "--checkpoint_every", "1", "--num_steps", "4"]) == 9
        err = capsys.readouterr().err
        assert "was made with a different" in err and "Traceback" not in err
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept  # nothing lost


def test_adapters_for_another_teacher_are_refused_naming_the_folder(tiny_teacher, tmp_path, capsys):
    from distill import evaluate
    from distill.models.tiny import TinyTeacherShape, write_tiny_teacher

    result = run(lora_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", num_steps=1))
    wider = write_tiny_teacher(tmp_path / "wider", shape=TinyTeacherShape(attention_head_dim=16))
    argv = ["--student", str(result.student_dir), "--teacher_path", str(wider)]
    argv += ["--prompts", str(REPO / "data" / "static_prompts.txt"), "--output_dir", str(tmp_path / "eval")]
    capsys.readouterr()
    assert evaluate.main(argv) == 3
    err = capsys.readouterr().err
    assert "do not fit this teacher's experts" in err and str(result.student_dir) in err


def test_a_phase_keeps_its_steps_and_noise_levels_on_its_side_of_the_boundary():
    from distill.models.few_step import few_step_scheduler, student_grid
    from distill.models.flow_matching import shift_sigmas
    from distill.train.methods.dmd import phase_steps, phase_uniform

    timesteps, _ = student_grid(few_step_scheduler(5.0), 4)  # 1000, 937.5, 833, 625: two per expert
    assert [phase_steps(timesteps, BOUNDARY, p) for p in ("both", "high", "low")] == [
        [0, 1, 2, 3],
        [0, 1],
        [2, 3],
    ]
    uniform = torch.linspace(0.0, 0.999, 101, dtype=torch.float64)
    high = shift_sigmas(phase_uniform(uniform, "high", 3.0, BOUNDARY), 3.0)
    low = shift_sigmas(phase_uniform(uniform, "low", 3.0, BOUNDARY), 3.0)
    assert high.min() >= BOUNDARY - 1e-9 and low.max() < BOUNDARY
    assert high.max() > 0.99 and low.min() == 0.0  # each covers its whole side
