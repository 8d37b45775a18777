"""Speed for a user's own model on the toy world, scored again from the shipped files.

assets/toy_user_lora/ is a user's LoRA of the toy teacher in the Wan/ComfyUI form (a palette the base
world lacks: distill.toy.user_world); assets/toy_student_user_lora/ is the 4-step speed LoRA the
trainer distilled against teacher + that LoRA (`python -m distill.toy.user_table --retrain`; `make
proofs` trains both again from scratch). Their record holds the four-row table at two noise seeds.
Here the speed LoRA is sampled again with the code of today at one seed on all 216 prompts, held to
its record sample by sample and, with today's row in place of the recorded one, to the bars; the
record's command is the recipe of today's code; and the pair loaded by stock WanPipeline as two
adapters draws what our own loaders (the teacher with the user's LoRA fused, the speed LoRA on it) do.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open

from distill import generate
from distill.sample.run_settings import read_run_settings
from distill.toy import user_lora, user_table
from distill.toy.t2v_students import mismatches
from distill.toy.user_stack import stacked_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")
FLIPS = 2  # as tests/test_toy_shipped_students.py: another CPU can round a sample on an edge otherwise
SEED = user_table.NOISE_SEEDS[0]


def record() -> dict:
    return json.loads((user_table.ASSET / user_table.RECORD_FILE).read_text())


@pytest.fixture(scope="module")
def today(toy_teacher) -> dict:
    """The shipped speed LoRA + the user's LoRA, 4 steps, noise seed SEED, all 216 prompts."""
    (row,) = user_table.score_rows(
        toy_teacher, user_lora.ASSET, user_table.ASSET, rows=["user_speed"], seeds=[SEED]
    )
    return row


def test_the_shipped_speed_lora_scores_today_what_its_record_says(today):
    was = user_table.find(record()["evaluation"]["rows"], "user_speed", SEED)
    assert today["count"] == was["count"] == 216
    assert mismatches(today["correct"], was["correct"]) <= FLIPS, (today["accuracy"], was["accuracy"])


def bars_today(today: dict) -> dict:
    """The bars of the record's rows with today's row in place of the recorded one."""
    rows = [
        r for r in record()["evaluation"]["rows"] if not (r["model"] == "user_speed" and r["seed"] == SEED)
    ]
    return user_table.bars([*rows, today])


def test_the_speed_lora_keeps_nine_tenths_of_the_reference(today):
    """At each noise seed, at least 0.9x the teacher + user LoRA at 20 steps, with today's row."""
    found = bars_today(today)
    shares = {name: bar for name, bar in found.items() if name.startswith("share_seed_")}
    assert len(shares) == len(user_table.NOISE_SEEDS)
    assert all(bar["met"] for bar in shares.values()), shares


@pytest.mark.xfail(
    strict=True,
    reason="measured: on the toy, the base speed LoRA stacked on the user's LoRA (0.963) is not beaten by "
    "the one distilled against teacher + user LoRA (0.940); docs/lora.md",
)
def test_the_speed_lora_beats_the_base_one_stacked_on_the_user_lora_beyond_noise(today):
    """Above the base speed LoRA + user LoRA on both seeds, by more than either row moves between the
    seeds and by a paired exact test (distill.toy.user_table)."""
    found = bars_today(today)
    assert found["gap_over_noise"]["met"] and found["paired_test"]["met"], found


def test_the_records_say_what_today_s_code_makes():
    """The speed LoRA's command is the trainer's LoRA recipe with --teacher_lora on the shipped pair;
    its run settings name that pair by the hash of the files shipped; the pair is in Wan's keys."""
    assert record()["command"] == user_table.command()
    assert record()["evaluation"]["bars"] == user_table.bars(record()["evaluation"]["rows"])
    assert "--teacher_lora assets/toy_user_lora" in record()["command"]
    settings = read_run_settings(user_table.ASSET / "run_settings.json")
    assert settings.trained_steps == 300 and settings.method == "dmd"
    shipped = {
        f"{user_table.USER_LORA_REF}/{name}": user_lora.ASSET / name for name in user_lora.FILES.values()
    }
    from distill.models.teacher_lora import parse_teacher_loras

    hashes = {str(lora.path.name): lora.sha256 for lora in parse_teacher_loras([str(user_lora.ASSET)], 2)}
    assert {lora["file"] for lora in settings.teacher_loras} == set(shipped)
    for lora in settings.teacher_loras:
        assert lora["sha256"] == hashes[lora["file"].rsplit("/", 1)[1]] and lora["scale"] == 1.0
    made = json.loads((user_lora.ASSET / user_lora.RECORD_FILE).read_text())
    assert made["command"] == user_lora.REBUILD and made["recipe"] == asdict(user_lora.UserLoraRecipe())
    assert made["teacher_20_steps"]["with_lora"]["user_world"] >= 0.9
    with safe_open(str(user_lora.ASSET / user_lora.FILES["high"]), "pt") as f:
        keys = list(f.keys())
    assert "diffusion_model.blocks.0.cross_attn.k.lora_down.weight" in keys
    assert "diffusion_model.blocks.0.cross_attn.k.alpha" in keys
    assert all(k.startswith("diffusion_model.blocks.") for k in keys)


def test_stock_wan_pipeline_with_both_adapters_draws_what_our_loaders_draw(toy_teacher):
    """Stock WanPipeline, the user's Wan-format pair and the speed LoRA's diffusers pair loaded as
    adapters and active together, against distill.generate (the trainer's teacher loader fusing the
    user's pair, the speed LoRA on it): the same latent for the same prompt, steps, scheduler and seed."""
    from distill.models.few_step import load_few_step_scheduler

    argv = ["--student", str(user_table.ASSET), "--teacher_path", str(toy_teacher)]
    argv += [
        "--teacher_lora",
        str(user_lora.ASSET),
        "--prompt",
        "a red bar in the top left on a black background",
    ]
    args = generate.build_parser().parse_args([*argv, "--output", "unused.png", "--device", "cpu"])
    pipe, prompts, _, _ = generate.prepare(args)
    ours = generate.render(pipe, args, prompts[0], args.seed, output_type="latent")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock = stacked_pipeline(toy_teacher, [("user", user_lora.ASSET), ("fast", user_table.ASSET)])
    # peft's "multiple adapters" warning is for stacking by mistake; `make demo-user-lora` stacks on purpose
    assert not [w for w in caught if "peft_config" in str(w.message)]
    stock.scheduler = load_few_step_scheduler(user_table.ASSET)
    theirs = generate.render(stock, args, prompts[0], args.seed, output_type="latent")
    assert args.steps == 4 and args.guidance == 1.0
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    bare = stacked_pipeline(toy_teacher, [("fast", user_table.ASSET)])
    bare.scheduler = stock.scheduler
    without = generate.render(bare, args, prompts[0], args.seed, output_type="latent")
    assert (without - ours).abs().max() > 0.1  # the user's LoRA is in the comparison
