"""The step benchmark (`python -m distill.bench`): its JSON has every field, with sane values.

Nothing here asserts on speed: only that the numbers exist, are positive and hang together.
"""

import json
import logging
import math

import pytest
import torch

from distill.bench import cli, measures, setup
from distill.bench.settings import A14B_EXPERT, SMALL_EXPERT, BenchSettings


def _positive_summary(summary: dict, keys=("median", "p10", "p90")) -> None:
    for key in keys:
        assert summary[key] > 0, (key, summary)
    assert summary[keys[1]] <= summary[keys[0]] <= summary[keys[2]], summary


def check_result(result: dict, settings: BenchSettings) -> None:
    assert result["preset"] == settings.preset
    assert result["settings"]["batch_size"] == settings.batch_size
    assert {"device", "device_name", "torch", "diffusers", "threads"} <= set(result["environment"])

    models = result["models"]
    assert models["tokens_per_sample"] > 0 and models["text_len"] == settings.text_len
    for name in ("teacher_expert", "student"):
        assert models[name]["params"] > 0 and models[name]["layers"] > 0

    steps = result["steps"]
    assert steps["timed_trainer"] >= settings.steps and steps["timed_bare"] >= settings.steps
    assert steps["instrumented"] == settings.steps
    assert steps["skipped_by_trainer"] == 0

    for loop in ("trainer", "bare"):
        summary = result[loop]
        _positive_summary(summary, ("median_ms", "p10_ms", "p90_ms"))
        assert summary["steps_per_s"] == pytest.approx(1e3 / summary["median_ms"])
        assert summary["samples_per_s"] == pytest.approx(settings.batch_size * summary["steps_per_s"])
    # No bound on speed here (a busy machine can make either loop slower): only that the ratio is
    # a real, finite quotient of the two medians. The bench prints the number; people judge it.
    assert 0 < result["overhead_ratio"] < float("inf")
    assert result["overhead_ratio"] == pytest.approx(
        result["trainer"]["median_ms"] / result["bare"]["median_ms"]
    )

    phases = result["phases_ms"]
    timed = ["data", "teacher", "student_forward", "student_backward", "optimizer"]
    if settings.method == "dmd":
        timed = [
            "data",
            "student_sampling",
            "teacher_real_score",
            "critic_fake_score",
            "generator_forward",
            "generator_backward",
            "generator_optimizer",
            "critic_forward",
            "critic_backward",
            "critic_optimizer",
        ]
    assert set(phases) == {*timed, "other", "step"}
    for name in (*timed, "step"):
        _positive_summary(phases[name])
    assert phases["other"]["median"] >= 0

    memory = result["memory"]
    floor = memory["floor"]
    for key in ("student_params", "student_grads", "optimizer_state", "teacher_weights"):
        assert floor[key] > 0, key
    # AdamW keeps two float32 moments per trained float32 parameter.
    assert floor["optimizer_state"] >= 2 * floor["student_grads"]
    assert memory["floor_bytes"] > 0
    assert memory["cpu_rss_peak_bytes"] > memory["floor_bytes"] or settings.device == "cuda"

    flops = result["flops"]
    assert flops["per_step"] == flops["teacher_per_step"] + flops["student_per_step"] > 0
    assert flops["achieved_per_s"] == pytest.approx(
        flops["per_step"] / (result["trainer"]["median_ms"] / 1e3)
    )
    assert result["wall_s"] > 0


def test_cpu_tiny_bench_writes_every_field(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = cli.main(["--preset", "cpu-tiny", "--steps", "4", "--warmup", "1", "--json", str(out)])
    settings, _ = cli.parse_args(["--preset", "cpu-tiny", "--steps", "4", "--warmup", "1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    check_result(result, settings)
    assert result["memory"]["cuda_max_allocated_bytes"] is None
    assert result["flops"]["mfu"] is None  # no peak is known for a CPU
    assert result["teacher_on_cpu"] is None
    printed = capsys.readouterr().out
    assert "overhead ratio" in printed and "student backward" in printed and "memory floor" in printed


def test_presets_and_overrides_parse():
    settings, path = cli.parse_args(
        [
            "--preset",
            "gpu-1.3b-pictures",
            "--teacher_layers",
            "2",
            "--no-compile",
            "--teacher_on_cpu",
            "--json",
            "x.json",
        ]
    )
    assert (settings.device, settings.dtype, settings.teacher_layers) == ("cuda", "bfloat16", 2)
    assert settings.teacher_on_cpu and not settings.compile and str(path) == "x.json"
    assert cli.parse_args(["--preset", "cpu-small"])[0].teacher == SMALL_EXPERT


def test_analytic_flops_match_the_flop_counter_on_everything_but_attention():
    """FlopCounterMode skips CPU attention kernels, so compare with the attention products removed."""
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    config = {
        **SMALL_EXPERT,
        "num_layers": 2,
        "num_attention_heads": 2,
        "ffn_dim": 96,
        "text_dim": 32,
    }
    model = WanTransformer3DModel(**config)
    batch, text_len, shape = 2, 7, setup.latent_shape(32, 48, 5)
    tokens = setup.tokens_per_sample(config, shape)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(
            hidden_states=torch.randn(batch, *shape),
            timestep=torch.tensor([10.0, 900.0]),
            encoder_hidden_states=torch.randn(batch, text_len, config["text_dim"]),
            return_dict=False,
        )
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    attention = config["num_layers"] * (4 * tokens * tokens * dim + 4 * tokens * text_len * dim)
    expected = batch * (measures.forward_flops(config, tokens, text_len) - attention)
    assert counter.get_total_flops() == expected


def test_teacher_cast_matches_from_pretrained(tmp_path):
    """The in-memory teacher has the dtypes `load_expert` gives: bf16, with diffusers' float32 islands."""
    from diffusers import WanTransformer3DModel

    config = {
        **SMALL_EXPERT,
        "num_layers": 1,
        "num_attention_heads": 2,
        "ffn_dim": 32,
        "text_dim": 16,
    }
    model = WanTransformer3DModel(**config)
    model.save_pretrained(tmp_path)
    loaded = WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    cast = setup.cast_as_loaded(model, torch.bfloat16)

    def dtypes(m):
        return {name: t.dtype for name, t in [*m.named_parameters(), *m.named_buffers()]}

    assert dtypes(cast) == dtypes(loaded)
    assert torch.float32 in dtypes(cast).values() and torch.bfloat16 in dtypes(cast).values()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("teacher_on_cpu", [False, True])
def test_gpu_preset_at_reduced_size(teacher_on_cpu):
    argv = [
        "--preset",
        "gpu-1.3b-pictures",
        "--teacher_layers",
        "1",
        "--student_layers",
        "2",
        "--height",
        "240",
        "--width",
        "416",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--block",
        "2",
    ]
    if teacher_on_cpu:
        argv.append("--teacher_on_cpu")
    settings, _ = cli.parse_args(argv)
    result = cli.main(argv)
    check_result(result, settings)
    memory = result["memory"]
    assert memory["cuda_max_reserved_bytes"] >= memory["cuda_max_allocated_bytes"] >= memory["floor_bytes"]
    assert 0 < result["flops"]["mfu"] < 1 or result["flops"]["peak_per_s"] is None
    placement = result["teacher_on_cpu"]
    if teacher_on_cpu:
        assert memory["teacher_host_bytes"] == memory["floor"]["teacher_weights"]
        assert placement["streamed_ms"]["median"] > 0 and placement["resident_ms"]["median"] > 0
        assert math.isfinite(placement["slowdown"])
    else:
        assert placement is None


def test_dmd_bench_times_a_whole_cycle_and_each_of_its_phases(capsys):
    argv = [
        "--preset",
        "cpu-tiny",
        "--method",
        "dmd",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--critic_updates",
        "2",
    ]
    settings, _ = cli.parse_args(argv)
    result = cli.main(argv)
    check_result(result, settings)
    assert result["method"] == "dmd" and result["train_steps_per_bench_step"] == 2
    floor = result["memory"]["floor"]
    # the critic has the student's shape: the same parameters, gradients and AdamW state
    assert floor["critic_params"] == floor["student_params"] > 0
    assert floor["critic_optimizer_state"] == floor["optimizer_state"]
    phases = result["phases_ms"]
    # one cycle holds a generator update and critic updates: both optimizers step inside it
    assert phases["critic_optimizer"]["median"] > 0 and phases["generator_optimizer"]["median"] > 0
    printed = capsys.readouterr().out
    assert "overhead ratio" in printed and "teacher real score" in printed and "critic fake score" in printed


def test_plan_check_puts_the_plan_beside_a_real_run(tmp_path, capsys):
    """`python -m distill.bench.plan_check` on the CPU at tiny sizes: its real column is a real run
    (LoRA on a checkpointed clip), which the plan matches, and a row is printed and written per figure."""
    from distill.bench import plan_check

    case = next(c for c in plan_check.cases(small=True) if c.use.lora_rank and c.use.layers == 4)
    plan, real = plan_check.planned(case), plan_check.measured(case, torch.device("cpu"))
    assert real[1] > real[0] > 0
    assert plan == pytest.approx(real, rel=0.01)
    if not torch.cuda.is_available():  # the CUDA default says what to run instead
        assert plan_check.main([]) == 0
        assert "--device cpu --small" in capsys.readouterr().out


def test_the_presets_name_and_have_the_shapes_users_train(caplog):
    """81 frames at 480x832 and 720x1280, one sample, checkpointed; the old one-frame name still works."""
    tokens = {"480p": 32_760, "720p": 75_600}
    for size, (height, width) in {"480p": (480, 832), "720p": (720, 1280)}.items():
        student, lora, teacher = (
            cli.parse_args(["--preset", f"gpu-{what}-{size}-81"])[0]
            for what in ("1.3b", "a14b-lora", "teacher")
        )
        for s in (student, lora, teacher):
            assert (s.height, s.width, s.num_frames, s.batch_size, s.dtype) == (
                height,
                width,
                81,
                1,
                "bfloat16",
            )
            shape = setup.latent_shape(s.height, s.width, s.num_frames)
            assert setup.tokens_per_sample(A14B_EXPERT, shape) == tokens[size]
        assert (student.workload, student.teacher_layers, student.gradient_checkpointing) == (
            "distill",
            4,
            True,
        )
        assert student.student == "config/student_config.json"
        # the LoRA step: one whole 40-layer expert, rank 64, checkpointed; the teacher: the whole expert
        assert (lora.workload, lora.teacher, lora.teacher_layers, lora.lora_rank) == (
            "lora",
            A14B_EXPERT,
            None,
            64,
        )
        assert lora.gradient_checkpointing and A14B_EXPERT["num_layers"] == 40
        assert (teacher.workload, teacher.teacher_layers, teacher.gradient_checkpointing) == (
            "teacher",
            None,
            False,
        )
    with caplog.at_level(logging.WARNING):
        old = cli.parse_args(["--preset", "gpu-1.3b"])[0]
    assert old == cli.parse_args(["--preset", "gpu-1.3b-pictures"])[0] and old.num_frames == 1
    assert "gpu-1.3b is now called gpu-1.3b-pictures" in caplog.text


def test_the_flop_count_holds_attention_as_counted_by_hand():
    """Attention is the only part of a forward quadratic in the tokens: its second difference in the
    token count is 2 x (4 x heads x head_dim) a block, and at 81 frames it is most of the 1.3B's work."""
    student = {**A14B_EXPERT, **{k: v for k, v in cli_student_config().items() if k in A14B_EXPERT}}
    layers, heads, head_dim = (
        student["num_layers"],
        student["num_attention_heads"],
        student["attention_head_dim"],
    )
    assert (layers, heads, head_dim) == (30, 12, 128)
    f = lambda n: measures.forward_flops(student, n, 512)  # noqa: E731
    n = 1000
    assert f(n + 1) - 2 * f(n) + f(n - 1) == 2 * layers * 4 * heads * head_dim
    # 480x832x81: 32,760 tokens; self-attention 4 * S^2 * heads * head_dim and cross-attention to 512
    # text tokens 4 * S * 512 * heads * head_dim per block, forward
    s = 32_760
    attention = layers * (4 * s * s * heads * head_dim + 4 * s * 512 * heads * head_dim)
    assert attention == 30 * (6_593_848_934_400 + 103_054_049_280)
    assert 0.65 < attention / f(s) < 0.75  # "about 70% of the 1.3B student's FLOPs"
    # the bench's student step counts it three times (forward, backward = 2 x forward), per sample
    settings = cli.parse_args(["--preset", "gpu-1.3b-480p-81"])[0]
    assert settings.batch_size == 1 and 3 * f(s) > 3 * attention


def cli_student_config() -> dict:
    return json.loads((setup.REPO / "config" / "student_config.json").read_text())


TINY_EXPERT = {**SMALL_EXPERT, "num_layers": 2, "num_attention_heads": 2, "ffn_dim": 64, "text_dim": 32}


@pytest.mark.parametrize("workload", ["lora", "teacher"])
def test_one_model_alone_lora_step_and_teacher_forward(workload, capsys):
    """The LoRA and teacher presets' bench on the CPU at a tiny size: every figure there, the FLOPs those
    of the run plan (attention included), the adapters alone trained."""
    from distill.bench.model_step import format_model_step
    from distill.bench.run import run_bench
    from distill.train.flops import model_flops

    settings = BenchSettings(
        preset="tiny-" + workload,
        teacher=TINY_EXPERT,
        workload=workload,
        lora_rank=4,
        batch_size=1,
        height=32,
        width=32,
        num_frames=5,
        text_len=16,
        steps=2,
        warmup=1,
        gradient_checkpointing=workload == "lora",
        attention_backend="native",
    )
    result = run_bench(settings)
    model, flops, memory = result["models"]["model"], result["flops"], result["memory"]
    assert (
        result["workload"] == workload and result["step"]["median_ms"] > 0 and result["steps"]["timed"] == 2
    )
    shape = tuple(result["models"]["latent_shape"])
    plan = model_flops(
        TINY_EXPERT, shape, 16, "lora" if workload == "lora" else "none", 4, setup_lora_targets()
    )
    if workload == "lora":
        assert 0 < model["trained_params"] < model["params"]
        assert memory["optimizer_state_bytes"] >= 2 * 4 * model["trained_params"]  # AdamW's two fp32 moments
        assert flops["per_step"] == plan.forward + plan.backward < flops["per_step_with_recompute"]
    else:
        assert model["trained_params"] == 0 and memory["optimizer_state_bytes"] == 0
        assert flops["per_step"] == 2 * plan.forward  # cond + uncond
    assert 0 < flops["attention_share_of_forward"] < 1 and flops["mfu"] is None  # no peak known for a CPU
    assert "sdpa_kernel" not in result["environment"]  # the probe is for CUDA only
    assert "attention backend: native" in format_model_step(result)


def setup_lora_targets() -> tuple:
    from distill.config.settings import LORA_TARGETS

    return LORA_TARGETS


def test_the_bench_refuses_an_attention_backend_as_the_trainer_does():
    from distill.ops.errors import DistillError

    with pytest.raises(DistillError, match="--attention_backend _native_cudnn needs CUDA"):
        cli.parse_args(["--preset", "cpu-tiny", "--attention_backend", "_native_cudnn"])
    assert (
        cli.parse_args(["--preset", "cpu-tiny", "--attention_backend", "native"])[0].attention_backend
        == "native"
    )
    assert cli.parse_args(["--preset", "cpu-tiny"])[0].attention_backend is None
