"""A causal LoRA student (--student_lora_rank with --student_chunk_frames): the teacher's experts attend
block-causally while they run the student's adapters and over the whole clip as the teacher and the
critic; each expert keeps its own KV cache of the finished chunks; a Self-Forcing run trains, resumes
bitwise and exports a lora/ folder that streams; what cannot work is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import imageio.v2 as imageio
import pytest
import torch
from conftest import run_streaming_card, train_args

from distill import generate
from distill.config.cli import parse_config
from distill.models.causal.attention import causal_layout, causal_pass
from distill.models.causal.experts import make_student_causal
from distill.models.causal.kv_cache import KVCache
from distill.models.causal.streaming import stream_latents
from distill.models.few_step import few_step_scheduler
from distill.models.lora import CRITIC_ADAPTER, STUDENT_ADAPTER, LoraExperts, LoraShape, route
from distill.models.lora_folder import read_lora_folder
from distill.models.teacher import inspect_teacher
from distill.models.tiny import build_tiny_pipeline
from distill.ops.errors import DistillError
from distill.sample.student_folder import load_lora_student, load_merged_student
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")

BOUNDARY = 0.875
FRAMES = 3  # latent frames: 3 chunks of 1


def causal_lora_experts() -> tuple[LoraExperts, torch.nn.Module, torch.nn.Module]:
    """The tiny teacher's experts with student and critic adapters that change what they compute
    (LoRA B drawn, not zero), the student's made causal over chunks of 1; and an untouched copy of
    each expert (the teacher as a plain WanTransformer3DModel)."""
    pipe, plain = build_tiny_pipeline(seed=0), build_tiny_pipeline(seed=0)
    lora = LoraExperts(pipe.transformer, pipe.transformer_2, LoraShape(4, 8.0), LoraShape(4, 4.0), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for switch in lora.switches.values():
            for key, p in switch.expert.named_parameters():
                if ".lora_B." in key:
                    p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    make_student_causal(lora, 1)
    return lora, plain.transformer, plain.transformer_2


def clip(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, FRAMES, 4, 4, generator=generator), torch.randn(1, 8, 32, generator=generator)


def first_chunk_moves(model, x: torch.Tensor, text: torch.Tensor, t: float) -> float:
    """How much the first chunk's output changes when only the last chunk's input changes."""
    changed = x.clone()
    changed[:, :, -1] += 1.0
    timestep = torch.tensor([t])
    with torch.no_grad():
        a, b = (
            model(hidden_states=y, timestep=timestep, encoder_hidden_states=text)[0] for y in (x, changed)
        )
    return float((a[:, :, 0] - b[:, :, 0]).abs().max())


@pytest.mark.parametrize(("which", "t"), [("high", 950.0), ("low", 300.0)])
def test_the_experts_are_causal_for_the_student_only(which: str, t: float) -> None:
    lora, plain_high, plain_low = causal_lora_experts()
    x, text = clip()
    student = lora.model(STUDENT_ADAPTER, BOUNDARY)
    critic = lora.model(CRITIC_ADAPTER, BOUNDARY)
    teacher = dict(zip(("high", "low"), lora.teacher_views()))[which]
    plain = plain_high if which == "high" else plain_low
    assert causal_layout(student) is not None and causal_layout(student).chunk_frames == 1

    assert first_chunk_moves(student, x, text, t) == 0.0  # chunk 0 sees chunk 0 only
    assert first_chunk_moves(critic, x, text, t) > 1e-4  # the critic judges whole clips
    assert first_chunk_moves(teacher, x, text, t) > 1e-4
    # The teacher's turn computes what Wan's own attention does on the same expert.
    timestep = torch.tensor([t])
    with torch.no_grad():
        ours = teacher(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        wan = plain(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(ours, wan, rtol=1e-5, atol=1e-5)


def test_each_expert_keeps_the_clean_chunks_keys_of_its_own() -> None:
    """The pass that adds a finished chunk to the cache runs both experts (t=0 would route it to the
    low-noise one alone): each holds, per layer, the keys and values of the clean chunks that one
    causal pass of that expert (the student's adapter on) over them gives."""
    lora, _, _ = causal_lora_experts()
    student = lora.model(STUDENT_ADAPTER, BOUNDARY)
    _, text = clip()
    cache = KVCache()
    chunks = list(
        stream_latents(
            student, few_step_scheduler(shift=5.0), 4, text, (16, FRAMES, 4, 4), seed=3, cache=cache
        )
    )
    assert [c.first_frame for c in chunks] == [0, 1, 2] and cache.chunks == [(0, 1), (1, 1)]
    clean = torch.cat([c.latents for c in chunks[:-1]], dim=2)
    layers = len(lora.switches["high"].expert.blocks)
    for which in ("high", "low"):
        reference = KVCache()
        with torch.no_grad(), causal_pass(student, start_frame=0, cache=reference, commit=True):
            student.run_expert(which, clean, torch.zeros(1), text)
        for layer in range(layers):
            held, expected = cache.read((which, layer)), reference.read((which, layer))
            assert held is not None and expected is not None, (which, layer)
            torch.testing.assert_close(held, expected, rtol=1e-5, atol=1e-5)


def test_a_sample_whose_tokens_straddle_the_boundary_is_refused_by_the_router() -> None:
    x = torch.zeros(2, 16, 2, 4, 4)
    text = torch.zeros(2, 8, 32)
    calls: list[tuple[str, int]] = []

    def call(which: str, hidden: torch.Tensor, t: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        calls.append((which, hidden.shape[0]))
        return hidden

    per_token = torch.tensor([[950.0] * 8, [300.0] * 8])  # each sample on one side: routed whole
    assert torch.equal(route(x, per_token, text, BOUNDARY, call), x)
    assert calls == [("high", 1), ("low", 1)]
    with pytest.raises(ValueError, match="both sides of the experts' boundary"):
        route(x, torch.tensor([[950.0] * 4 + [300.0] * 4] * 2), text, BOUNDARY, call)


# ---------------------------------------------------------------------------------------------
# Runs on the tiny teacher
# ---------------------------------------------------------------------------------------------


def lora_causal_args(teacher: Path, out: Path, cache: Path, **overrides: object) -> list[str]:
    settings: dict[str, object] = dict(
        method="self_forcing",
        student_chunk_frames=1,
        student_lora_rank=4,
        student_config=None,
        critic_updates=2,
        num_frames=9,
        height=32,
        width=32,
        max_prompts=4,
        num_steps=4,
    )
    settings.update(overrides)
    return train_args(teacher, out, cache, **settings)


def run(args: list[str]):
    return Distiller(parse_config(args)).run()


def adapters(folder: Path) -> dict[str, torch.Tensor]:
    return {f"{w}.{k}": v for w, state in read_lora_folder(folder)[1].items() for k, v in state.items()}


def test_a_causal_lora_student_trains_by_self_forcing_resumes_bitwise_and_streams(
    tiny_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    common = dict(checkpoint_every=2, ema_decay=0.9)
    straight = run(
        lora_causal_args(
            tiny_teacher, tmp_path / "straight", cache, export_formats="diffusers,merged", **common
        )
    )
    rows = [json.loads(x) for x in (straight.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["critic_loss"] == r["critic_loss"] for r in rows)
    lora = straight.output_dir / "lora"
    trained = adapters(lora)
    # The student moved off the teacher: some LoRA B (zero at the start) is not zero any more.
    assert max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k) > 0

    monkeypatch.setenv("DISTILL_INJECT_FAULT", "exception:3")
    with pytest.raises(RuntimeError, match="injected exception at step 3"):
        run(lora_causal_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    resumed = run(lora_causal_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    assert resumed.resumed_from.name == "step_00000002"
    for folder in ("lora", "lora_ema"):
        a, b = adapters(straight.output_dir / folder), adapters(resumed.output_dir / folder)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder

    # lora/ records the chunk size, its card says how to stream it, and it streams 3x the clip.
    assert json.loads((lora / "causal_config.json").read_text())["chunk_frames"] == 1
    card = (lora / "README.md").read_text()
    assert "It is causal" in card and "ComfyUI apply the adapters" in card
    for folder in ("lora", "merged"):  # merged/: the experts with the adapters in, causal each
        video = tmp_path / f"stream_{folder}"
        code = generate.main(
            [
                *("--student", str(straight.output_dir / folder), "--teacher_path", str(tiny_teacher)),
                *("--stream", "--height", "32", "--width", "32", "--num_frames", "33"),
                *("--prompt", "a red ball", "--output", str(video)),
            ]
        )
        assert code == 0 and imageio.get_reader(video.with_suffix(".mp4")).count_frames() == 33, folder
        # Its card's Python streams 3x the trained clip as written (the wan-distill sampler).
        assert (
            run_streaming_card(straight.output_dir / folder, monkeypatch, tmp_path / f"card_{folder}") == 33
        )
    # Without --stream the stock pipeline renders it whole (the adapters as diffusers loads them), and says so.
    whole = tmp_path / "whole"
    code = generate.main(
        [
            *("--student", str(lora), "--teacher_path", str(tiny_teacher)),
            *("--height", "32", "--width", "32", "--num_frames", "9", "--prompt", "a red ball"),
            *("--output", str(whole)),
        ]
    )
    assert code == 0 and imageio.get_reader(whole.with_suffix(".mp4")).count_frames() == 9
    assert "is a causal student: --stream makes the clips" in caplog.text


def test_a_bidirectional_lora_student_learns_by_ode_init_and_is_not_streamed(
    tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ode_init gives every frame its chunk's timestep (one per token); a bidirectional LoRA student's
    frames share one, and the router sends each sample whole to its expert. Its lora/ folder has
    nothing to stream, nor has its merged/: --stream says so and how to train one that does."""
    args = lora_causal_args(
        tiny_teacher,
        tmp_path / "ode",
        tmp_path / "cache",
        method="ode_init",
        student_chunk_frames=None,
        critic_updates=None,
        export_formats="diffusers,merged",
    )
    result = run(args)
    rows = [json.loads(x) for x in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(loss == loss for loss in losses)
    for folder, holds in (("lora", "adapters"), ("merged", "merged experts")):
        assert not (result.output_dir / folder / "causal_config.json").exists()
        code = generate.main(
            [
                *("--student", str(result.output_dir / folder), "--teacher_path", str(tiny_teacher)),
                *("--stream", "--height", "32", "--width", "32", "--num_frames", "9"),
                *("--prompt", "a red ball", "--output", str(tmp_path / "never")),
            ]
        )
        err = capsys.readouterr().err
        assert code != 0 and f"holds the {holds} of a bidirectional LoRA student" in err, folder
        assert "--student_chunk_frames 3 and --method self_forcing" in err
        assert not list(tmp_path.glob("never*"))


def test_what_a_causal_lora_student_cannot_do_is_refused_with_the_fix(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    args = lora_causal_args(
        tiny_teacher, tmp_path / "out", tmp_path / "cache", method="ode_init", critic_updates=None
    )
    with pytest.raises(DistillError) as refused:
        Distiller(parse_config(args))
    assert "--method ode_init cannot train a causal LoRA student" in refused.value.title
    assert any("--method self_forcing" in fix for fix in refused.value.fixes)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("method", "kind"),
    [("dmd", "t2v"), ("velocity", "t2v"), ("self_forcing", "ti2v"), ("ode_init", "ti2v")],
)
def test_every_method_trains_a_causal_lora_student_whose_export_is_causal(
    method: str, kind: str, tiny_teacher: Path, ti2v_teacher: Path, tmp_path: Path
) -> None:
    """dmd and velocity train the causal LoRA student with one causal forward over the whole clip;
    TI2V-5B (one transformer, no boundary) trains it by self_forcing and by ode_init too. Each run's
    adapters move, and the student it trained, its lora/ loaded back and its merged/ experts are
    causal: the first chunk's output does not see the last chunk's input, at a high-noise and a
    low-noise timestep. merged/ streams what lora/ streams."""
    teacher = ti2v_teacher if kind == "ti2v" else tiny_teacher
    overrides: dict[str, object] = {
        "method": method,
        "num_steps": 2,
        "student_init": None,
        "export_formats": "diffusers,merged",
    }
    if method in ("velocity", "ode_init"):
        overrides["critic_updates"] = None
    if kind == "ti2v":  # 5 frames through its 16x VAE: 2 latent frames, chunks of 1
        overrides.update(num_frames=5, guidance_scale=5.0)
    distiller = Distiller(
        parse_config(lora_causal_args(teacher, tmp_path / "out", tmp_path / "cache", **overrides))
    )
    result = distiller.run()
    rows = [json.loads(x) for x in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r[k] for r in rows for k in ("loss", "critic_loss") if k in r]
    assert losses and all(loss == loss for loss in losses)
    lora = result.output_dir / "lora"
    assert max(float(v.abs().max()) for k, v in adapters(lora).items() if "lora_B" in k) > 0
    assert json.loads((lora / "causal_config.json").read_text())["chunk_frames"] == 1

    merged = result.output_dir / "merged"
    subfolders = ("transformer",) if kind == "ti2v" else ("transformer", "transformer_2")
    for folder in (merged, *(merged / name for name in subfolders)):
        assert json.loads((folder / "causal_config.json").read_text())["chunk_frames"] == 1, folder

    info = inspect_teacher(str(teacher))
    cpu = torch.device("cpu")
    trained = distiller.lora.model(STUDENT_ADAPTER, info.boundary_ratio)
    exported = load_lora_student(lora, info, cpu, torch.float32)[0]
    as_merged = load_merged_student(merged, info, cpu, torch.float32)
    generator = torch.Generator().manual_seed(0)
    frames = 2 if kind == "ti2v" else FRAMES
    x = torch.randn(1, info.expert_config["in_channels"], frames, 4, 4, generator=generator)
    text = torch.randn(1, 8, info.expert_config["text_dim"], generator=generator)
    for name, student in (("trained", trained.eval()), ("exported", exported), ("merged", as_merged)):
        for t in (950.0, 300.0):
            assert first_chunk_moves(student, x, text, t) == 0.0, (name, t)
    # Each merged expert keeps its own keys in the KV cache, as the adapters' experts do (measured: 5e-7 apart).
    shape = (info.expert_config["in_channels"], frames, 4, 4)
    streamed = [
        torch.cat(
            [
                c.latents
                for c in stream_latents(
                    model, few_step_scheduler(5.0), 4, text, shape, seed=3, kind=info.kind
                )
            ],
            dim=2,
        )
        for model in (exported.eval(), as_merged)
    ]
    torch.testing.assert_close(streamed[1], streamed[0], rtol=1e-5, atol=1e-5)
