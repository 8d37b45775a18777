"""Training a causal student (--student_chunk_frames): the Self-Forcing rollout, where its gradient goes,
gradient checkpointing under the KV cache, ode_init and self_forcing runs on the tiny T2V and I2V
teachers (resume, export, streaming the export), and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import imageio.v2 as imageio
import pytest
import torch
import torch.utils.checkpoint
from conftest import REPO, run_streaming_card, train_args
from safetensors.torch import load_file
from test_i2v_training import write_pairs

from distill import generate
from distill.config.cli import parse_config
from distill.models.causal.attention import causal_checkpointing, make_causal
from distill.models.causal.layout import CausalLayout, write_causal_config
from distill.models.causal.rollout import rollout_clip
from distill.models.causal.streaming import stream_latents
from distill.models.conditioning import model_timestep
from distill.models.few_step import few_step_scheduler, student_grid
from distill.models.student import build_student, init_student_from_teacher
from distill.models.student_config import load_student_config
from distill.models.teacher import inspect_teacher, load_expert
from distill.models.teacher_kind import I2V_A14B, T2V_A14B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError
from distill.train.run_checks import check_causal_start
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK, FRAMES, STEPS = 1, 3, 4  # 3 chunks of 1 latent frame (a 9-frame clip), the student's 4 steps


def causal_expert(teacher: Path) -> torch.nn.Module:
    expert = load_expert(inspect_teacher(str(teacher)), "transformer", torch.float32)
    return make_causal(expert.requires_grad_(True), CHUNK)  # loaded frozen, as a teacher


def clip_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, FRAMES, 8, 8, generator=generator), torch.randn(1, 7, 32, generator=generator)


def grid() -> tuple[torch.Tensor, torch.Tensor]:
    return student_grid(few_step_scheduler(shift=5.0), STEPS)


def test_the_training_rollout_at_the_last_step_is_the_clip_the_student_streams(tiny_teacher: Path) -> None:
    """Self-Forcing trains on the clip inference makes: exiting at the last step, the rollout (its
    cache, context passes and re-noising) equals stream_latents from the same numbers."""
    model = causal_expert(tiny_teacher)
    _, text = clip_inputs()
    streamed = torch.cat(
        [
            c.latents
            for c in stream_latents(
                model, few_step_scheduler(shift=5.0), STEPS, text, (16, FRAMES, 8, 8), seed=5
            )
        ],
        dim=2,
    )
    generator = torch.Generator().manual_seed(5)
    noise = torch.randn(1, 16, FRAMES, 8, 8, generator=generator)
    calls = 0

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        # The streamer also draws the last step's re-noising (its sigma is 0); the rollout stops before it.
        nonlocal calls
        calls += 1
        drawn = torch.randn(shape, generator=generator)
        if calls % (STEPS - 1) == 0:
            torch.randn(shape, generator=generator)
        return drawn

    timesteps, sigmas = grid()
    with torch.no_grad():
        rolled = rollout_clip(model, noise, text, timesteps, sigmas, draw, STEPS - 1)
    torch.testing.assert_close(rolled, streamed, rtol=0, atol=1e-5)


def test_gradient_flows_only_through_each_chunks_exit_step(tiny_teacher: Path) -> None:
    model = causal_expert(tiny_teacher)
    noise, text = clip_inputs(1)
    timesteps, sigmas = grid()
    seen: list[tuple[int, bool]] = []
    model.register_forward_hook(
        lambda _m, args, kwargs, out: seen.append(
            (round(float(kwargs["timestep"][0])), out[0].requires_grad)
        ),
        with_kwargs=True,
    )

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(len(seen)))

    # Exit at step 2: per chunk two steps without gradient, the exit step with it, then (not after the
    # last chunk) the t=0 pass that adds the chunk to the cache, without gradient.
    rollout_clip(model, noise, text, timesteps, sigmas, draw, exit_step=2).sum().backward()
    t = [round(float(x)) for x in timesteps[:3]]
    chunk = [(t[0], False), (t[1], False), (t[2], True)]
    assert seen == [*chunk, (0, False), *chunk, (0, False), *chunk]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    # Exit at step 0 the exit forward reads each chunk's noise itself: the gradient of the last chunk's
    # output reaches its own noise only; the earlier chunks reach it through the cache, which is detached.
    noise.requires_grad_(True)
    rollout_clip(model, noise, text, timesteps, sigmas, draw, exit_step=0)[:, :, 2].sum().backward()
    per_frame = noise.grad.abs().sum(dim=(0, 1, 3, 4))
    assert per_frame[2] > 0 and per_frame[:2].eq(0).all(), per_frame
    # ...and the control: with the earlier chunks' estimates summed too, their noise gets gradient.
    noise.grad = None
    rollout_clip(model, noise, text, timesteps, sigmas, draw, exit_step=0).sum().backward()
    assert noise.grad.abs().sum(dim=(0, 1, 3, 4)).gt(0).all()


def test_a_rollout_longer_than_the_clip_returns_and_trains_only_its_judged_window(tiny_teacher: Path) -> None:
    """judged_from: the chunks before it are the judged window's context, made as the others are but
    without gradient; the window is the same numbers as the rollout of the whole stream."""
    model = causal_expert(tiny_teacher)
    generator = torch.Generator().manual_seed(3)
    noise, text = torch.randn(1, 16, 5, 8, 8, generator=generator), torch.randn(1, 7, 32, generator=generator)
    timesteps, sigmas = grid()
    seen: list[bool] = []
    model.register_forward_hook(lambda _m, _a, out: seen.append(out[0].requires_grad))

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(len(seen)))

    window = rollout_clip(model, noise, text, timesteps, sigmas, draw, 1, window=2, judged_from=2)
    assert window.shape[2] == 3 and window.requires_grad
    # Per chunk: step 0 and the exit step 1, then the t=0 context pass (none after the last chunk);
    # only the exit forwards of chunks 2, 3 and 4 carry gradient.
    exits = [seen[i * 3 + 1] for i in range(5)]
    assert exits == [False, False, True, True, True] and sum(seen) == 3, seen
    seen.clear()
    with torch.no_grad():
        whole = rollout_clip(model, noise, text, timesteps, sigmas, draw, 1, window=2)
    torch.testing.assert_close(window.detach(), whole[:, :, 2:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="judged_from 5"):
        rollout_clip(model, noise, text, timesteps, sigmas, draw, 1, judged_from=5)


def test_gradient_checkpointing_gives_the_gradients_of_the_rollout_without_it(tiny_teacher: Path) -> None:
    """The blocks recomputed in backward run after the rollout moved on (another chunk, a longer cache):
    causal_checkpointing replays each forward's own pass, so the gradients are those without it."""
    noise, text = clip_inputs(2)
    timesteps, sigmas = grid()

    def gradients(checkpointing: str | None) -> list[torch.Tensor]:
        model = causal_expert(tiny_teacher).train()
        if checkpointing == "causal":
            model.enable_gradient_checkpointing(causal_checkpointing(model))
        elif checkpointing == "stock":
            model.enable_gradient_checkpointing()
        generator = torch.Generator().manual_seed(3)
        x0 = rollout_clip(
            model, noise, text, timesteps, sigmas, lambda s: torch.randn(s, generator=generator), 1
        )
        (x0 * torch.linspace(-1, 1, x0.numel()).view_as(x0)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, causal = gradients(None), gradients("causal")
    for a, b in zip(plain, causal, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # The control: diffusers' own checkpointing recomputes every block under the pass set at backward
    # time (none: the whole clip from frame 0, without the cache), which torch catches as other shapes.
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different metadata"):
        gradients("stock")


def test_a_checkpointed_rollout_holds_each_chunks_keys_once(tiny_teacher: Path) -> None:
    """Until backward, each chunk's checkpointed exit step keeps the KV cache as it saw it. The
    snapshots share the chunks' tensors, so what the rollout holds grows with the chunks, not with the
    sum of their prefixes (a cache grown by concatenation held chunk 0 once per later chunk: 8 more
    frames then cost 2.1x what the first 8 did)."""
    from distill.ops.live_memory import LiveTensorMemory

    model = causal_expert(tiny_teacher).train()
    model.enable_gradient_checkpointing(causal_checkpointing(model))
    timesteps, sigmas = grid()

    def held(frames: int) -> int:
        generator = torch.Generator().manual_seed(0)
        noise = torch.randn(1, 16, frames, 8, 8, generator=generator)
        text = torch.randn(1, 7, 32, generator=generator)
        with LiveTensorMemory() as memory:
            memory.hold([*model.parameters(), *model.buffers(), noise, text])
            start = memory.live
            clip = rollout_clip(
                model, noise, text, timesteps, sigmas, lambda s: torch.randn(s, generator=generator), 0
            )
            kept = memory.live - start
        del clip
        return kept

    one, nine, seventeen = held(1), held(9), held(17)
    assert seventeen - nine < 1.2 * (nine - one), (one, nine, seventeen)


def test_one_timestep_per_latent_frame_reaches_every_token_of_its_frame(tiny_teacher: Path) -> None:
    model = load_expert(inspect_teacher(str(tiny_teacher)), "transformer", torch.float32)
    noise, text = clip_inputs(4)
    per_frame = torch.tensor([[900.0, 500.0, 100.0]])
    tokens = model_timestep(T2V_A14B, per_frame, noise)
    assert tokens.shape == (1, 3 * 16) and tokens.view(3, 16).unique(dim=1).flatten().tolist() == [
        900,
        500,
        100,
    ]
    assert torch.equal(model_timestep(I2V_A14B, per_frame, noise), tokens)
    assert model_timestep(T2V_A14B, per_frame, noise, patch=(1, 1)).shape == (1, 3 * 64)  # a 1x1-patch model
    with torch.no_grad():  # all frames at one t: the per-token forward is the per-sample one
        same = model_timestep(T2V_A14B, torch.full((1, 3), 700.0), noise)
        torch.testing.assert_close(
            model(noise, same, text, return_dict=False)[0],
            model(noise, torch.tensor([700.0]), text, return_dict=False)[0],
            rtol=0,
            atol=1e-5,
        )


# ---------------------------------------------------------------------------------------------
# Runs on the tiny teachers
# ---------------------------------------------------------------------------------------------


def run(args: list[str]):
    return Distiller(parse_config(args)).run()


def causal_args(teacher: Path, out: Path, cache: Path, **overrides: object) -> list[str]:
    settings: dict[str, object] = dict(
        method="self_forcing",
        student_chunk_frames=CHUNK,
        num_frames=9,
        height=32,
        width=32,
        max_prompts=4,
        num_steps=3,
        student_init="teacher",
    )
    settings.update(overrides)
    if settings["method"] == "self_forcing":
        settings.setdefault("critic_updates", 2)
    return train_args(teacher, out, cache, **settings)


def student_weights(out: Path, name: str = "student") -> dict[str, torch.Tensor]:
    return load_file(str(out / name / "diffusion_pytorch_model.safetensors"))


def test_self_forcing_trains_resumes_bitwise_and_its_export_streams(
    tiny_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    common = dict(num_steps=4, checkpoint_every=2, ema_decay=0.9)
    straight = run(causal_args(tiny_teacher, tmp_path / "straight", cache, **common))
    rows = [json.loads(x) for x in (straight.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["critic_loss"] is not None and r["critic_loss"] == r["critic_loss"] for r in rows)
    assert all(abs(r["loss"]) < 1e3 for r in rows if "loss" in r)
    # The student learned: its weights moved away from the teacher's blocks it started from.
    info = inspect_teacher(str(tiny_teacher))
    start = build_student(
        load_student_config(REPO / "config" / "student_tiny.json", info.expert_config), seed=0
    )
    init_student_from_teacher(start, load_expert(info, "transformer_2", torch.float32))
    moved = student_weights(straight.output_dir)
    assert max((moved[k] - v).abs().max() for k, v in start.state_dict().items()) > 1e-6

    monkeypatch.setenv("DISTILL_INJECT_FAULT", "exception:3")
    with pytest.raises(RuntimeError, match="injected exception at step 3"):
        run(causal_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    resumed = run(causal_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    assert resumed.resumed_from.name == "step_00000002"
    meta = json.loads((resumed.resumed_from / "meta.json").read_text())
    assert meta["identity"]["method"] == "self_forcing" and meta["identity"]["student_chunk_frames"] == CHUNK
    for name in ("student", "student_ema"):
        a, b = student_weights(straight.output_dir, name), student_weights(resumed.output_dir, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    # The export is causal again on load and streams longer than trained: 3x (27 latent frames... 33 video).
    student = straight.output_dir / "student"
    assert json.loads((student / "causal_config.json").read_text())["chunk_frames"] == CHUNK
    assert (student / "scheduler_config.json").is_file()
    assert json.loads((student / "run_settings.json").read_text())["chunk_frames"] == CHUNK
    card = (student / "README.md").read_text()
    assert "It is causal" in card and "--continue_with" in card  # how to stream it, and to go on past it
    assert run_streaming_card(student, monkeypatch, tmp_path / "card") == 33  # ... in Python, as written
    video = tmp_path / "stream"
    code = generate.main(
        [
            *("--student", str(student), "--teacher_path", str(tiny_teacher), "--stream"),
            *("--height", "32", "--width", "32", "--num_frames", "33", "--prompt", "a red ball"),
            *("--output", str(video)),
        ]
    )
    assert code == 0 and imageio.get_reader(video.with_suffix(".mp4")).count_frames() == 33

    # Resuming the causal run as a bidirectional one is refused, with the flag that continues it.
    with pytest.raises(DistillError, match="student chunk frames"):
        run(causal_args(tiny_teacher, tmp_path / "resumed", cache, **{**common, "student_chunk_frames": 3}))


def test_self_forcing_judges_random_windows_of_a_rollout_longer_than_the_clip(
    tiny_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--rollout_frames 17 (5 latent frames) of a 9-frame clip: every rollout streams to the end of a
    3-frame window drawn among the 3 chunk-aligned ones, on generate --stream's default KV window."""
    from distill.train.methods import self_forcing

    rollouts: list[tuple[int, int, int | None, int]] = []

    def spy(student: torch.nn.Module, noise: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        clip = rollout_clip(student, noise, *args, **kwargs)
        rollouts.append((noise.shape[2], kwargs["judged_from"], kwargs["window"], clip.shape[2]))
        return clip

    judged: list[tuple[int, torch.Tensor | None]] = []
    positions = self_forcing.SelfForcingMethod.judged_positions

    def judged_positions(method: self_forcing.SelfForcingMethod, *args: object) -> torch.Tensor | None:
        judged.append((method.judged_from, positions(method, *args)))
        return judged[-1][1]

    monkeypatch.setattr(self_forcing, "rollout_clip", spy)
    monkeypatch.setattr(self_forcing.SelfForcingMethod, "judged_positions", judged_positions)
    common = dict(rollout_frames=17, checkpoint_every=2)
    result = run(causal_args(tiny_teacher, tmp_path / "long", tmp_path / "cache", num_steps=4, **common))
    assert result.last_loss == result.last_loss and len(rollouts) == 6  # 4 critic, 2 generator updates
    starts = [start for _, start, _, _ in rollouts]
    assert all(
        frames == start + 3 and window == 2 and judged == 3 for frames, start, window, judged in rollouts
    )
    assert set(starts) <= {0, 1, 2} and len(set(starts)) > 1, starts
    # The generator update leaves out a window's first latent frame unless the window starts the stream.
    assert [start for start, _ in judged] == [starts[0], starts[3]]  # steps 1 and 3 update the student
    for start, weight in judged:
        if start == 0:
            assert weight is None
        else:
            assert weight is not None and weight[:, :, 0].eq(0).all() and weight[:, :, 1:].eq(1).all()
    meta = json.loads((result.output_dir / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["identity"]["rollout_frames"] == 17
    # Another rollout length is another objective: the run does not continue under it.
    with pytest.raises(DistillError, match="rollout frames"):
        run(causal_args(tiny_teacher, tmp_path / "long", tmp_path / "cache", num_steps=6, rollout_frames=33))


@pytest.fixture(scope="module")
def i2v_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("causal_i2v")
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    (root / "student.json").write_text(json.dumps({**config, "in_channels": 36}))
    return {
        "teacher": write_tiny_teacher(root / "teacher", seed=0, kind=I2V_A14B),
        "pairs": write_pairs(root / "data", size=32),
        "student": root / "student.json",
    }


@pytest.mark.parametrize("method", ["ode_init", "self_forcing", "self_forcing_lora"])
def test_the_causal_methods_train_an_image_to_video_student(
    i2v_world: dict[str, Path], tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each causal method on the tiny I2V teacher, and Self-Forcing of a causal LoRA student (the
    image enters each expert's cache pass of the first chunk too); each export's card streams it
    from a first frame, as written."""
    lora = method.endswith("_lora")
    args = causal_args(
        i2v_world["teacher"],
        tmp_path / method,
        tmp_path / "cache",
        method=method.removesuffix("_lora"),
        data_path=i2v_world["pairs"],
        student_config=None if lora else i2v_world["student"],
        student_init=None if lora else "teacher",
        student_lora_rank=4 if lora else None,
        num_steps=2,
    )
    result = run(args)
    assert result.last_loss is not None and result.last_loss == result.last_loss
    export = result.output_dir / ("lora" if lora else "student")
    assert (export / "causal_config.json").is_file()
    image = i2v_world["pairs"].parent / "images" / "0.png"
    assert run_streaming_card(export, monkeypatch, tmp_path / "card", image) == 33


def test_a_longer_rollout_of_image_to_video_samples_is_refused_before_the_teacher_loads(
    i2v_world: dict[str, Path], tmp_path: Path
) -> None:
    args = causal_args(
        i2v_world["teacher"],
        tmp_path / "out",
        tmp_path / "cache",
        data_path=i2v_world["pairs"],
        student_config=i2v_world["student"],
        rollout_frames=17,
    )
    with pytest.raises(DistillError) as refused:
        Distiller(parse_config(args))
    assert "--rollout_frames 17 cannot be combined with image-to-video samples" in refused.value.title
    assert any("leave --rollout_frames out" in fix for fix in refused.value.fixes)
    assert not (tmp_path / "cache").exists()


def test_ode_init_lowers_its_regression_loss(tiny_teacher: Path, tmp_path: Path) -> None:
    result = run(
        causal_args(tiny_teacher, tmp_path / "ode", tmp_path / "cache", method="ode_init", num_steps=6)
    )
    assert result.last_loss < 0.5 * result.first_loss, (result.first_loss, result.last_loss)


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message", "fix"),
    [
        (
            dict(student_chunk_frames=None),
            "--method self_forcing needs a causal student",
            "--student_chunk_frames 3",
        ),
        (
            dict(num_frames=13, student_chunk_frames=3),
            "--num_frames 13 is 4 latent frames",
            "--num_frames 21, 33, 45",
        ),
        (dict(dmd_inputs="data"), "--dmd_inputs data cannot be combined", "drop --dmd_inputs"),
        (dict(regression_weight=0.5), "--regression_weight cannot be combined", "--method ode_init"),
        (dict(student_chunk_frames=-1), "--student_chunk_frames -1", "--student_chunk_frames 3"),
        (
            dict(rollout_frames=5),
            "--rollout_frames 5 is shorter than --num_frames 9",
            "--rollout_frames 33, 37",
        ),
        (dict(rollout_frames=31), "--rollout_frames 31 is not whole chunks", "--rollout_frames 33, 37, 41"),
        (
            dict(rollout_frames=29, student_chunk_frames=3),
            "--rollout_frames 29 is not whole chunks of --student_chunk_frames 3",
            "--rollout_frames 33, 45, 57",
        ),
        (
            dict(rollout_frames=33, method="dmd"),
            "--rollout_frames needs --method self_forcing",
            "--method self_forcing",
        ),
    ],
)
def test_what_a_causal_student_cannot_do_is_refused_with_the_fix(
    tiny_teacher: Path, overrides: dict[str, object], message: str, fix: str
) -> None:
    with pytest.raises(DistillError) as refused:
        parse_config(causal_args(tiny_teacher, Path("unused"), Path("unused"), **overrides))
    assert message in refused.value.title and any(fix in f for f in refused.value.fixes), refused.value


def test_settings_at_their_off_values_are_accepted(tiny_teacher: Path) -> None:
    cfg = parse_config(
        causal_args(tiny_teacher, Path("u"), Path("u"), dmd_inputs="simulate", regression_weight=0)
    )
    assert cfg.method == "self_forcing" and cfg.student_chunk_frames == CHUNK
    cfg = parse_config(train_args(tiny_teacher, Path("u"), Path("u"), student_chunk_frames=0))
    assert not cfg.student_chunk_frames and cfg.method == "velocity"
    # The clip's own rollout, named: 0 or --num_frames, with any method.
    for method, rollout in (("self_forcing", 9), ("self_forcing", 0), ("dmd", 9), ("ode_init", 0)):
        cfg = parse_config(
            causal_args(tiny_teacher, Path("u"), Path("u"), method=method, rollout_frames=rollout)
        )
        assert cfg.rollout_frames == rollout


def test_a_causal_start_is_not_trained_bidirectionally(tmp_path: Path) -> None:
    folder = tmp_path / "causal"
    folder.mkdir()
    write_causal_config(folder, CausalLayout(3))
    with pytest.raises(DistillError, match="is a causal student") as refused:
        check_causal_start(str(folder), None)
    assert refused.value.fixes == ["add --student_chunk_frames 3 to keep training it causal"]
    check_causal_start(str(folder), 3)
    check_causal_start(str(tmp_path), None)  # a bidirectional start: nothing to keep


@pytest.mark.parametrize("student", ["separate", "lora"])
def test_two_ranks_train_a_causal_student_by_self_forcing_as_one_process(
    tiny_teacher: Path, tmp_path: Path, student: str
) -> None:
    """DDP with a rollout that makes several forwards carry gradient (one per chunk) before one
    backward: 2 ranks of batch 1 give the losses and gradient norms of one process of batch 2. The
    rollout is longer than the clip (--rollout_frames): each rank streams to the same judged window,
    the chunks before it without gradient. A LoRA student: the teacher's experts, each with its own
    KV cache, the exit steps of one update all on one expert (the other's adapters without gradient)."""
    from test_distributed import assert_same_trajectory, launch

    lora = dict(student_lora_rank=4, student_config=None, student_init=None) if student == "lora" else {}

    def args(nproc: int, batch: int) -> list[str]:
        return causal_args(
            tiny_teacher,
            tmp_path / f"n{nproc}",
            tmp_path / "cache",
            batch_size=batch,
            log_every=1,
            rollout_frames=17,
            **lora,
        )

    two = launch(args(2, 1), nproc=2).stderr
    result = run(args(1, 2))
    assert (result.output_dir / ("lora" if lora else "student") / "causal_config.json").is_file()
    keys = ("loss", "grad_norm", "critic_loss", "critic_grad_norm")
    # dmd's losses are differences of near-equal scores: step 1 used 16-22% of 1e-5 on one CPU, and
    # another CPU model moved such a loss up to 5x more (test_sequence_parallel). Ranks that did not
    # share their gradients, or read other samples, are off by far more.
    assert_same_trajectory([tmp_path / "n1", tmp_path / "n2"], first_rtol=1e-4, rtol=1e-3, keys=keys)
    assert "all 2 ranks hold identical student and critic weights" in two
