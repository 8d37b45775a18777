"""The window teacher (distill/toy/window_teacher.py): the toy teacher's experts trained further on windows
of the world's 33-frame streams, everything else the source's; what it learned is measured in
docs/streaming.md (a 20-minute run), its plumbing here on a few samples."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from distill.models.teacher import inspect_teacher
from distill.toy import world
from distill.toy.recipe import Recipe
from distill.toy.shipped import ASSETS
from distill.toy.vae_fit import encode_scenes
from distill.toy.window_teacher import EXPERTS, STREAM_FRAMES, WINDOW, main, stream_windows

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = ["--steps", "2", "--streams", "3", "--pictures", "4", "--clips", "4"]


def test_a_window_teacher_changes_its_experts_only_and_records_its_training(tmp_path, capsys):
    out = tmp_path / "window-teacher"
    assert main(["--output_dir", str(out), *SMALL]) == 0
    assert "judge it: python -m distill.toy.window_judge" in capsys.readouterr().out
    assert inspect_teacher(out).kind == inspect_teacher(ASSETS).kind
    for name in ("vae", "text_encoder", "tokenizer", "scheduler"):
        for path in (ASSETS / name).rglob("*"):
            if path.is_file():
                assert (out / path.relative_to(ASSETS)).read_bytes() == path.read_bytes(), path
    for name in EXPERTS:
        (file,) = (out / name).glob("*.safetensors")
        trained, shipped = load_file(file), load_file(ASSETS / name / file.name)
        assert trained.keys() == shipped.keys()
        assert any(not torch.equal(trained[k], shipped[k]) for k in shipped), name
    described = json.loads((out / world.WORLD_FILE).read_text())
    training = described.pop("window_training")
    assert described == json.loads((ASSETS / world.WORLD_FILE).read_text())
    assert training["streams"] == 3 and training["recipe"]["expert_steps"] == 2
    assert training["recipe"]["trained_experts"] == ["high", "low"]
    assert not list(tmp_path.glob(".*partial*"))  # the staging folder became the teacher


def test_an_output_folder_that_holds_files_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["--output_dir", str(out), *SMALL]) == 3  # a setting's error
    err = capsys.readouterr().err
    assert "--output_dir" in err and "already holds files" in err
    assert (out / "notes.txt").read_text() == "mine\n" and [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_windows_are_the_streams_latents_after_its_clip(toy_teacher):
    """A stream's first WINDOW latent frames encode its 9-frame clip (the VAE's encoder is causal), so
    the clips already teach the window at latent frame 0; the windows cut start one frame later."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(toy_teacher / "vae").eval()
    scenes = world.sample_scenes(2, 5, clips=True)
    windows = stream_windows(vae, scenes)
    starts = (STREAM_FRAMES - 1) // 4 + 1 - WINDOW
    assert windows.shape == (starts * 2, 16, WINDOW, 4, 4)
    with torch.no_grad():
        clips = encode_scenes(vae, scenes, Recipe())
    # the window at latent frame 1 begins with the clip's last two latent frames
    torch.testing.assert_close(windows[:2, :, : WINDOW - 1], clips[:, :, 1:], rtol=1e-4, atol=1e-4)
    # window k + 1 is window k moved on by one latent frame
    torch.testing.assert_close(windows[2:4, :, : WINDOW - 1], windows[:2, :, 1:])
