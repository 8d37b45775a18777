"""Shared pytest fixtures."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# Settings of a user's shell that change what the libraries or the trainer do: the hub offline or
# elsewhere, a token or a cache of theirs, wandb switched off, a launcher's ranks, a fault to inject.
# The suite must give the same result in any shell (`HF_HUB_OFFLINE=1 make test` was red: the tests
# that stand in for the hub were told it was offline), so they are cleared here, before any test
# module imports huggingface_hub or wandb (both read them at import); the runs the tests start inherit
# the cleaned environment, and a test that needs one sets it itself (monkeypatch.setenv).
# tests/test_environment.py runs the hub tests in a shell that sets every one of them.
USER_SETTINGS = (
    "HF_HUB_OFFLINE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_ENDPOINT",
    "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_CACHE",
    "HF_DATASETS_OFFLINE",
    "WANDB_MODE",
    "WANDB_DISABLED",
    "WANDB_API_KEY",
    "WANDB_PROJECT",
    "WANDB_ENTITY",
    "WANDB_DIR",
    "WANDB_BASE_URL",
    "DISTILL_INJECT_FAULT",
    "DISTILL_DEBUG",
    "WAN_DISTILL_CONVERT_DIR",
    "DDP_BACKEND",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
)
for _name in USER_SETTINGS:
    os.environ.pop(_name, None)
# The user's own Hugging Face folder (a saved login token, their hub cache) is not the suite's either:
# an empty one of this process's, removed when it ends.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="wan-distill-test-hf-home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)

# Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json (both experts share it): the real sizes for
# memory plans, without weights.
A14B_EXPERT = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)

# A small WanTransformer3DModel config (2 heads x 16, 2 layers) for plans and FLOP counts that run the
# real model: override what a test varies.
SMALL_EXPERT = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=24,
    freq_dim=32,
    ffn_dim=48,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)


# The modules that train toy students for minutes (`make test --durations`: 2-4 min each on one
# core), longest first: they start before everything else.
HEAVIEST_MODULES = (
    "test_toy_clip_dmd.py",
    "test_toy_distill.py",
    "test_toy_lora.py",
    "test_toy_clip_lora.py",
    "test_toy_dmd.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest modules first, then those marked `long`: `make test` hands whole modules to its
    two workers (--dist loadfile, so a module's expensive fixtures are built once), and the longest
    ones started last would leave one worker alone at the end. The sort is stable: every module's
    tests stay together and in order."""

    def order(item: pytest.Item) -> tuple[int, bool]:
        name = item.path.name
        heavy = HEAVIEST_MODULES.index(name) if name in HEAVIEST_MODULES else len(HEAVIEST_MODULES)
        return heavy, item.get_closest_marker("long") is None

    items.sort(key=order)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker():
    """Every test computes on one thread: `make test` runs two workers on two cores, and a worker
    training on two threads while the other worker computes ran 10-20x slower than on one (a
    200-step tiny run took 232 s instead of 13 s: the threads wait on each other). Subprocesses get
    OMP_NUM_THREADS=1 from the Makefile."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def plan_measurements_of_this_session(tmp_path_factory: pytest.TempPathFactory):
    """Every run logs its memory plan, measured on fake tensors (seconds per model use): the suite's
    processes (both workers, and the runs they start) share one measurement folder, started empty each
    session, so a suite never reads numbers an earlier one measured (distill/train/measurement_cache.py)."""
    from distill.train.measurement_cache import PLAN_CACHE_ENV

    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker has its own folder in the session's: the parent is shared.
    session = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ[PLAN_CACHE_ENV] = str(session / "plan-measurements")
    yield


@pytest.fixture(scope="module")
def one_thread():
    """For modules that train the toy models (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    they are tiny, and on 2 cores one thread ran them 3-10x faster than two when anything else ran
    (the threads wait on each other)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Wan 2.2 T2V A14B teacher (seed 0, default shape), built once per session.

    Shared by many tests: copy it (shutil.copytree) before changing anything in it.
    """
    from distill.models.tiny import write_tiny_teacher  # imports torch and diffusers

    return write_tiny_teacher(tmp_path_factory.mktemp("tiny_teacher") / "teacher", seed=0)


@pytest.fixture(scope="session")
def toy_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained toy Wan 2.2 teacher (assets/toy_teacher/, with toy_world.json), copied once per
    session. Shared: copy it before changing anything in it."""
    from distill.toy.shipped import write_toy_teacher

    return write_toy_teacher(tmp_path_factory.mktemp("toy_teacher") / "teacher")


REPO = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    """PYTHONPATH for subprocesses: the repository first, then whatever the caller already had."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def train_args(teacher: Path, output_dir: Path, cache_dir: Path, **overrides: object) -> list[str]:
    """Command-line arguments of a small, fast training run on a tiny teacher."""
    settings: dict[str, object] = {
        "teacher_path": teacher,
        "student_config": REPO / "config" / "student_tiny.json",
        "data_path": REPO / "data" / "static_prompts.txt",
        "output_dir": output_dir,
        "cache_dir": cache_dir,
        "height": 16,
        "width": 16,
        "num_frames": 1,
        "teacher_sample_steps": 2,
        "max_prompts": 8,
        "batch_size": 2,
        "num_steps": 6,
        "lr": 1e-3,
        "log_every": 1,
        "checkpoint_every": 0,
        "seed": 0,
        # CPU and gloo even on a GPU node: results then match bit for bit and need no GPU per rank.
        "device": "cpu",
        "backend": "gloo",
    }
    if overrides.get("method") == "dmd":  # dmd refuses a random start: begin from the teacher's blocks
        settings["student_init"] = "teacher"
    settings.update(overrides)
    args: list[str] = []
    for key, value in settings.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not None and value is not False:
            args += [f"--{key}", str(value)]
    return args


def clip_prompt_file(folder: Path, count: int = 432) -> Path:
    """A prompt file of `count` clip prompts in the scorer's shuffled order (every motion, every
    attribute; the scored prompts are its first ones): a toy clip run in the suite trains on these
    instead of all 1,944, whose text embeddings and teacher latents would cost a minute more."""
    from distill.toy.evaluation import eval_prompts

    path = folder / "clip_prompts.txt"
    path.write_text("\n".join(eval_prompts(count, clips=True)) + "\n")
    return path


@pytest.fixture(scope="session")
def run_wide_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest-xdist worker of this run shares (each worker's temporary folders lie
    inside it): for results that cost a minute and do not depend on which test asks."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "shared-results"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def toy_teacher_clip_scores(toy_teacher: Path, run_wide_folder: Path) -> Callable[..., dict]:
    """`scores(prompts, steps=None)`: the toy teacher's clip scores on `prompts` at `steps` (None: its
    full step count), with its own guidance and the scorer's fixed noise; computed once per suite run (under a lock, whichever
    worker asks first) and read back by every other test that asks for the same ones. Every worker's
    toy teacher is a copy of the same shipped one, so the result does not depend on who computed it."""
    import hashlib
    import json

    from filelock import FileLock

    from distill.toy.evaluation import load_experts, sample_pictures, score_pictures
    from distill.toy.world import CLIP_FRAMES, guidance_of

    world = json.loads((toy_teacher / "toy_world.json").read_text())
    guidance = guidance_of(world, clips=True)

    def scores(prompts: list[str], steps: int | None = None) -> dict:
        steps = steps or world["sample_steps"]
        key = hashlib.sha256("\n".join([str(steps), *prompts]).encode()).hexdigest()[:16]
        path = run_wide_folder / f"toy-teacher-clips-{key}.json"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                high, low = load_experts(toy_teacher)
                clips = sample_pictures(
                    toy_teacher,
                    prompts,
                    transformer=high,
                    transformer_2=low,
                    steps=steps,
                    guidance_scale=guidance[0],
                    guidance_scale_2=guidance[1],
                    num_frames=CLIP_FRAMES,
                )
                staged = path.with_suffix(".partial")  # a worker killed mid-write leaves no half file
                staged.write_text(json.dumps(score_pictures(clips, prompts)))
                os.replace(staged, path)
            return json.loads(path.read_text())

    return scores


def clip_guidance(teacher: Path) -> dict[str, float]:
    """The toy teacher's own guidance on clips, as train_args overrides (a dmd run's real score)."""
    import json

    from distill.toy.world import guidance_of

    high, low = guidance_of(json.loads((teacher / "toy_world.json").read_text()), clips=True)
    return {"guidance_scale": high, "guidance_scale_2": low}


def assert_clips_keep_up_with_the_teacher(
    teacher_scores: Callable[..., dict], prompts: list[str], student: dict, student_at_one_step: dict
) -> None:
    """The bar a few-step student on clips must clear, against the toy teacher (its own clip
    guidance) on the same prompts and noise: at least 0.9x the teacher's full-step accuracy, motion
    ratio 0.85-1.15 (no slow motion, no exaggerated motion), at most twice the teacher's diversity
    gap, and at one step 0.3 above the teacher at one step (`teacher_scores`: the
    toy_teacher_clip_scores fixture). Not asserted: beating the teacher at the student's 4 steps. At
    its clip guidance the toy teacher is as good at 4 steps as at 20 (0.92 / 0.91): the toy clips
    show no cost of 4 steps for a student to win back (docs/toy-world.md)."""
    full, one_step = teacher_scores(prompts), teacher_scores(prompts, 1)
    figures = {
        name: (r["accuracy"], r["motion_ratio"], r["diversity_gap"])
        for name, r in (
            ("student", student),
            ("student, one step", student_at_one_step),
            ("teacher, full", full),
            ("teacher, one step", one_step),
        )
    }
    assert student["accuracy"] >= 0.9 * full["accuracy"], figures
    assert 0.85 <= student["motion_ratio"] <= 1.15, figures
    assert student["diversity_gap"] <= 2 * full["diversity_gap"], figures
    assert student_at_one_step["accuracy"] >= one_step["accuracy"] + 0.3, figures


def load_teacher_parts(teacher: Path, prompts: list[str]) -> tuple:
    """(info, high-noise expert, low-noise expert, {prompt: embedding}) of a teacher on the CPU in
    float32; the embeddings cover `prompts` and the empty negative prompt."""
    import torch

    from distill.models.pipelines import encode_prompts
    from distill.models.teacher import inspect_teacher, load_expert

    info = inspect_teacher(str(teacher))
    embeddings = encode_prompts(info.path, [*prompts, ""], 512, torch.device("cpu"), torch.float32)
    return (
        info,
        load_expert(info, "transformer", torch.float32),
        load_expert(info, "transformer_2", torch.float32),
        embeddings,
    )


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder shared by runs with the default train_args settings (built once)."""
    return tmp_path_factory.mktemp("cache")
