"""Shared pytest fixtures."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
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

# The tiny teacher's expert shape (10 heads of 12): a student that starts from the teacher's
# high-noise expert (dmd, a causal student) has it.
TEACHER_SHAPE = dict(num_attention_heads=10, ffn_dim=240)


def tiny_student_file(path: Path, **changes: object) -> Path:
    """config/student_tiny.json with `changes`, written to `path`; returns `path`."""
    path.write_text(json.dumps(json.loads((REPO / "config" / "student_tiny.json").read_text()) | changes))
    return path


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


# The modules that take longest on one worker (`make test --durations`), longest first: they start
# before everything else.
HEAVIEST_MODULES = (
    "test_stress.py",
    "test_toy_methods_clips.py",
    "test_toy_shipped_students.py",
    "test_toy_methods_i2v.py",
    "test_toy_methods_pictures.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """The CPU each module costs, printed after the run (tests/cpu_report.py): what the suite's time
    on two busy cores is made of. Registered as a plugin, so it measures test_error_handling.py's
    tests too, which live outside this folder."""
    import cpu_report

    cpu_report.register(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest modules first, then those marked `long`: `make test` hands whole modules to its
    workers (--dist loadfile, so a module's expensive fixtures are built once), and the longest
    ones started last would leave one worker alone at the end. The sort is stable: every module's
    tests stay together and in order."""

    def order(item: pytest.Item) -> tuple[int, bool]:
        name = item.path.name
        heavy = HEAVIEST_MODULES.index(name) if name in HEAVIEST_MODULES else len(HEAVIEST_MODULES)
        return heavy, item.get_closest_marker("long") is None

    items.sort(key=order)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker():
    """Every test computes on one thread: `make test` runs three workers on two cores, and a
    worker training on two threads while another worker computes ran 10-20x slower than on one (a
    200-step tiny run took 232 s instead of 13 s: the threads wait on each other). Subprocesses get
    OMP_NUM_THREADS=1 from the Makefile."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def plan_measurements_of_this_session(tmp_path_factory: pytest.TempPathFactory):
    """Every --dry_run (and every run on an accelerator) measures its memory plan on fake tensors
    (seconds per model use): the suite's
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
def ti2v_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Wan 2.2 TI2V-5B teacher (seed 0: one transformer, the Wan2.2 VAE), built once per
    session. Shared: copy it before changing anything in it."""
    from distill.models.teacher_kind import TI2V_5B
    from distill.models.tiny import write_tiny_teacher

    return write_tiny_teacher(tmp_path_factory.mktemp("ti2v_teacher") / "teacher", seed=0, kind=TI2V_5B)


@pytest.fixture(scope="session")
def toy_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained toy Wan 2.2 teacher (assets/toy_teacher/, with toy_world.json), copied once per
    session. Shared: copy it before changing anything in it."""
    from distill.toy.shipped import write_toy_teacher

    return write_toy_teacher(tmp_path_factory.mktemp("toy_teacher") / "teacher")


REPO = Path(__file__).resolve().parents[1]

# Multi-rank launches: the runs that check what training computes (N ranks equal one process, sharded
# equals whole) start their ranks warm (tests/warm_torchrun.py: torchrun itself, each rank forked after
# the imports, ~7 CPU-s a rank saved; run_command forks the launcher too, from a server per worker that
# imported them once); the runs that check failures launch as users do.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WARM_TORCHRUN = [sys.executable, str(REPO / "tests" / "warm_torchrun.py")]
# One process started the same way (run_command): `python SCRIPT ARGS` as [*WARM_PYTHON, SCRIPT, ARGS].
WARM_PYTHON = [*WARM_TORCHRUN, "--python"]


def run_command(command: list, **kwargs: object):
    """subprocess.run(command, capture_output=True, text=True, **kwargs) (env, cwd, timeout); a
    WARM_TORCHRUN launch is forked from a server that has imported the trainer (tests/warm_torchrun.py)."""
    import warm_torchrun  # imports the trainer: not at conftest's import, which xdist's controller runs too

    return warm_torchrun.run([str(part) for part in command], **kwargs)


def start_command(command: list, **kwargs: object):
    """subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True, **kwargs) (env, cwd), forked warm
    as run_command's."""
    import warm_torchrun

    return warm_torchrun.start([str(part) for part in command], **kwargs)


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


def preempt_then_finish(
    train: Callable[[list[str]], int],
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    at_step: int = 2,
    when_stopped: Callable[[], None] | None = None,
) -> None:
    """Run `args` in this process until a real SIGTERM at `at_step` (DISTILL_INJECT_FAULT: the trainer's
    own handler saves a checkpoint there and `train` returns 75), then run them again: it resumes from
    that checkpoint and finishes (0). In this process, not a new one: the signal path is the same, and
    the run it is compared with computes on the same thread count (the same bits).
    tests/test_resilience.py and the stress scenarios send it to a separate process and to one rank of
    two. `when_stopped` checks what the stopped run left before it is resumed."""
    monkeypatch.setenv("DISTILL_INJECT_FAULT", f"sigterm:{at_step}")
    assert train(args) == 75
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    if when_stopped is not None:
        when_stopped()
    capsys.readouterr()
    assert train(args) == 0
    resumed = [line for line in capsys.readouterr().err.splitlines() if "resumed from" in line]
    assert resumed and f"step_{at_step:08d}" in resumed[0], resumed


def run_streaming_card(
    folder: Path, monkeypatch: pytest.MonkeyPatch, where: Path, image: Path | None = None
) -> int:
    """Run the streaming code of a causal student's model card (`folder`/README.md) as written, in
    `where` (with `image` as the card's first frame, image to video); the number of frames in the
    MP4 it writes."""
    import re

    import imageio.v2 as imageio

    from distill.sample.card_code import EXAMPLE_IMAGE

    blocks = re.findall(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S)
    code = next(block for block in blocks if "open_stream" in block)
    where.mkdir(parents=True, exist_ok=True)
    if image is not None:
        shutil.copy(image, where / EXAMPLE_IMAGE)
    monkeypatch.chdir(where)
    exec(code, {"__name__": "card"})
    return imageio.get_reader(where / "stream.mp4").count_frames()
