"""Plan before the download: `download_wan.py --configs_only` fetches the teacher's configs and nothing
else (huggingface_hub's own pattern filter over a repository listing, no network), `--dry_run` then
prints the plan from those configs alone (offline, saying the weights are not there yet), and a real
run on that folder stops with a banner naming the folder and the download command."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from conftest import A14B_EXPERT, REPO, train_args
from huggingface_hub.utils import filter_repo_objects

import download_wan
from train_distillation import main

# The files of Wan-AI/Wan2.2-T2V-A14B-Diffusers besides what the tiny teacher writes (sharded weights
# with their index, the SentencePiece vocabulary, the repository's own files).
REAL_REPO_EXTRAS = (
    "README.md",
    ".gitattributes",
    "assets/comp_effic.png",
    "text_encoder/model-00001-of-00005.safetensors",
    "text_encoder/model.safetensors.index.json",
    "tokenizer/spiece.model",
    "tokenizer/special_tokens_map.json",
    "transformer/diffusion_pytorch_model-00001-of-00012.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "transformer_2/diffusion_pytorch_model-00001-of-00012.safetensors",
    "transformer_2/diffusion_pytorch_model.safetensors.index.json",
    "vae/diffusion_pytorch_model.safetensors",
)
CONFIGS = {
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/special_tokens_map.json",
    "transformer/config.json",
    "transformer_2/config.json",
    "vae/config.json",
}


def hub_of(monkeypatch: pytest.MonkeyPatch, source: Path) -> dict:
    """A Hub repository holding `source`'s files and REAL_REPO_EXTRAS: snapshot_download writes the
    files its allow_patterns select (huggingface_hub's filter), as the real one does."""
    files = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    listing = sorted({*files, *REAL_REPO_EXTRAS})
    seen: dict = {}

    def snapshot_download(**kwargs):
        seen.update(kwargs)
        local = Path(kwargs["local_dir"])
        for name in filter_repo_objects(listing, allow_patterns=kwargs.get("allow_patterns")):
            target = local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if (source / name).is_file():
                shutil.copyfile(source / name, target)
            else:
                target.write_text("{}" if name.endswith(".json") else "stub")
        seen["written"] = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return seen


def test_configs_only_fetches_the_configs_and_no_weights(tiny_teacher, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen = hub_of(monkeypatch, tiny_teacher)
    folder = tmp_path / "wan"
    assert download_wan.main(["--configs_only", "--local_dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert seen["allow_patterns"] == list(download_wan.CONFIG_PATTERNS)
    assert set(seen["written"]) == CONFIGS, (
        "the configs, and neither weights, weight indexes nor vocabularies"
    )
    assert f"python download_wan.py --local_dir {folder}" in out and "--dry_run" in out

    # Offline, the same command only checks what is there.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **_: pytest.fail("contacted the Hub"))
    assert download_wan.main(["--configs_only", "--local_dir", str(folder)]) == 0
    # The full download of the same folder is still to come: --verify says what is missing.
    assert download_wan.main(["--verify", str(folder)]) == 5
    assert "transformer/ has no weight files" in capsys.readouterr().err


def test_configs_only_is_a_download_option(capsys):
    with pytest.raises(SystemExit) as usage:
        download_wan.main(["--tiny", "x", "--configs_only"])
    assert (
        usage.value.code == 2 and "--configs_only cannot be combined with --tiny" in capsys.readouterr().err
    )


@pytest.fixture
def configs_only_teacher(tiny_teacher: Path, tmp_path: Path) -> Path:
    """The tiny teacher as --configs_only leaves it: its weights removed."""
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, folder)
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    return folder


def test_a_dry_run_plans_from_the_configs_alone_offline(configs_only_teacher, tmp_path, monkeypatch, capsys):
    """Even with a hub id as the student's start (whose weights a dry run never reads)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = train_args(
        configs_only_teacher,
        tmp_path / "out",
        tmp_path / "cache",
        student_init="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        dry_run=True,
    )
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (
        "weights : not there yet (text_encoder/, vae/, transformer/, transformer_2/ hold configs only)" in out
    )
    assert f"python download_wan.py --local_dir {configs_only_teacher}" in out
    assert "memory per device" in out and "GPU-hours" in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_real_run_on_configs_only_stops_naming_the_folder_and_the_download(
    configs_only_teacher, tmp_path, capsys
):
    assert main(train_args(configs_only_teacher, tmp_path / "out", tmp_path / "cache")) == 5
    err = capsys.readouterr().err
    assert f"the teacher folder {configs_only_teacher} holds configs but no weights yet" in err
    assert (
        f"python download_wan.py --preset wan2.2-t2v-a14b --local_dir {configs_only_teacher}" in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_recipe_prints_its_headers_plan_from_a14b_configs(
    configs_only_teacher, tmp_path, monkeypatch, capsys
):
    """The LoRA recipe's own command with --dry_run, on a configs-only folder whose experts have the
    A14B config: the memory per GPU and the GPU-hours its header states."""
    for expert in ("transformer", "transformer_2"):
        config = configs_only_teacher / expert / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **A14B_EXPERT}))
    recipe = REPO / "config" / "recipes" / "a14b-lora-4step-1xh200.yaml"
    header = recipe.read_text()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--config", str(recipe), "--teacher_path", str(configs_only_teacher), "--dry_run"]
    assert main([*argv, "--output_dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    total = re.search(r"^  total\s+([\d.]+)", out, re.M)[1]  # the gpu column: this recipe's placement
    assert f"teacher on the GPU): {total} GiB" in header
    hours = re.search(r"whole run: ([\d.]+) GPU-hours", out)[1]
    assert f"H100 at MFU 0.4): {hours} " in header and "weights : not there yet" in out


def hub_cache_with(folder: Path, repo_id: str, source: Path) -> None:
    """A Hugging Face hub cache under `folder` holding `source`'s files as repo `repo_id`'s snapshot."""
    commit = "0" * 40
    repo = folder / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo / "snapshots" / commit)


def test_a_dry_run_given_a_hub_id_plans_from_its_cached_configs_and_training_wants_the_weights(
    configs_only_teacher, tmp_path, monkeypatch, capsys
):
    """A dry run of a hub id reads (or fetches) only the configs; a real run of the same id with only
    the configs cached goes for the whole repository, and offline says how to get it."""
    cache = tmp_path / "hub"
    hub_cache_with(cache, "Wan-AI/Tiny-Test-Teacher", configs_only_teacher)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = train_args(Path("Wan-AI/Tiny-Test-Teacher"), tmp_path / "out", tmp_path / "cache")
    assert main([*args, "--dry_run"]) == 0
    assert "GPU-hours" in capsys.readouterr().out
    assert main(args) == 5
    err = capsys.readouterr().err
    assert "could not fetch the teacher Wan-AI/Tiny-Test-Teacher" in err and "Traceback" not in err
    assert "python download_wan.py --repo_id Wan-AI/Tiny-Test-Teacher" in err
