"""`make gpu-check` (distill/gpu_check.py) on a CPU machine: it says there is nothing to check, the steps
it would run on one and on two GPUs, and the table and JSON it makes from steps that really ran."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, repo_pythonpath

from distill import gpu_check
from distill.bench import cli as bench_cli
from distill.gpu_check import (
    Step,
    StepResult,
    format_table,
    plan_steps,
    pytest_step,
    run_step,
    skipped_steps,
    summary,
    unavailable,
)


def test_without_cuda_it_says_so_exits_0_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu-check"
    proc = subprocess.run(
        [sys.executable, "-m", "distill.gpu_check", "--output_dir", str(out)],
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": repo_pythonpath(),
            "CUDA_VISIBLE_DEVICES": "",
        },  # no GPU, even on one
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == gpu_check.NO_CUDA and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no folder, no JSON that could pass for a result


def test_an_unknown_step_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--only", "bench-eagre"])
    assert stop.value.code == 2
    assert "bench-eagre" in capsys.readouterr().err and "bench-eager" in gpu_check.__doc__


def test_two_gpus_add_the_nccl_step_and_every_step_runs_something_real():
    one, two = ([step.name for step in plan_steps(n)] for n in (1, 2))
    clips = ["clip-eager", "clip-compiled", "lora-81", "teacher-81"]
    backends = ["attention-native_cudnn", "attention-native_flash", "attention-flash", "attention-flex"]
    assert one == ["gpu-tests", "bench-eager", "bench-compiled", *clips, *backends, "teacher-streamed-81"]
    assert two == ["gpu-tests", "sharded-lora-nccl", *one[1:]]
    assert [r.name for r in skipped_steps(1)] == ["sharded-lora-nccl"] and skipped_steps(2) == []
    assert skipped_steps(1)[0].status == "skipped" and "needs 2 GPUs" in skipped_steps(1)[0].note
    steps = {step.name: step for step in plan_steps(2)}
    # The bench steps are command lines distill.bench accepts, with the settings each promises.
    bench = [step for step in steps.values() if step.reads == "bench"]
    settings = {
        step.name: bench_cli.parse_args(list(step.args[2:]))[0] for step in bench if not unavailable(step)
    }
    assert {settings[name].preset for name in ("bench-eager", "bench-compiled")} == {"gpu-1.3b-pictures"}
    assert settings["bench-compiled"].compile and not settings["bench-eager"].teacher_on_cpu
    streamed = settings["teacher-streamed-81"]
    assert streamed.teacher_on_cpu and streamed.num_frames == 81 and streamed.batch_size == 1
    for name in ("clip-eager", "clip-compiled", "lora-81", "teacher-81"):
        assert (settings[name].height, settings[name].width, settings[name].num_frames) == (480, 832, 81)
    assert settings["clip-compiled"].compile and settings["clip-eager"].attention_backend is None
    assert (settings["lora-81"].workload, settings["teacher-81"].workload) == ("lora", "teacher")
    for name in backends:  # each at the clip shape, under its own backend (flex compiled)
        step = steps[name]
        assert (
            step.backend
            and step.args[3] == "gpu-1.3b-480p-81"
            and ("--compile" in step.args) == (name == "attention-flex")
        )
    # A backend whose package is missing is skipped with what to install, not run to fail.
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn" in unavailable(steps["attention-flash"])
    assert unavailable(steps["attention-native_cudnn"]) == "" and unavailable(steps["clip-eager"]) == ""
    # The test steps name test files that exist; the NCCL one is left out of `-m gpu` and run on its own.
    nccl = REPO / gpu_check.TWO_GPU_TEST
    assert nccl.is_file() and str(nccl) in steps["sharded-lora-nccl"].args
    assert ["--ignore", str(nccl)] == list(steps["gpu-tests"].args[-4:-2])


def test_the_table_and_the_json_come_from_steps_that_really_ran(tmp_path):
    """Real steps on the CPU: a benchmark, a passing test, a bench that refuses its flags, and the GPU
    tests, which all skip here: nothing checked is a failure, not a pass."""
    tiny = [
        "-m",
        "distill.bench",
        "--preset",
        "cpu-tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--dtype",  # the student's float32 RMSNorm weights meet bfloat16 inputs: torch warns
        "bfloat16",
        "--json",
        "bench.json",
    ]
    one_test = f"{REPO}/tests/test_commands.py::test_every_listed_command_exists"
    steps = [
        Step("bench-cpu", "distill.bench cpu-tiny", tuple(tiny), "bench", "bench.json"),
        pytest_step("one-test", "a quick real test", one_test),
        Step("bench-bad", "a refused flag", ("-m", "distill.bench", "--steps", "0"), "bench", "bad.json"),
        pytest_step("gpu-tests", "pytest -m gpu", "-m", "gpu", f"{REPO}/tests/test_gpu.py"),
    ]
    results = [run_step(step, tmp_path, timeout_s=300) for step in steps] + skipped_steps(1)
    status = {r.name: r.status for r in results}
    assert status == {
        "bench-cpu": "passed",
        "one-test": "passed",
        "bench-bad": "failed",
        "gpu-tests": "failed",
        "sharded-lora-nccl": "skipped",
    }, [(r.name, r.note) for r in results]
    by_name = {r.name: r for r in results}
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert by_name["bench-cpu"].figures["overhead_ratio"] == bench["overhead_ratio"]
    assert by_name["bench-cpu"].figures["mfu"] is None and by_name["bench-cpu"].seconds > 0
    assert by_name["one-test"].figures == {"tests": 1, "failures": 0, "errors": 0, "skipped": 0, "passed": 1}
    assert "--steps: must be 1 or more" in by_name["bench-bad"].note  # the banner's title, quoted
    assert "no test ran" in by_name["gpu-tests"].note and by_name["gpu-tests"].figures["passed"] == 0

    table = format_table(results).splitlines()
    assert [cell.strip() for cell in table[0].split(" | ")] == ["step", "result", "time", "figures"]
    rows = {line.split(" | ")[0].strip(): line for line in table[2:]}
    assert list(rows) == [r.name for r in results]
    assert f"overhead {bench['overhead_ratio']:.3f}" in rows["bench-cpu"] and "MFU" not in rows["bench-cpu"]
    assert "1 passed" in rows["one-test"] and " | skipped | -" in rows["sharded-lora-nccl"]
    # the warning's row names the model code that raised it, not torch's frame
    mismatch = [w for w in bench["warnings"] if w["message"].startswith("Mismatch dtype between input")]
    assert len(mismatch) == 1 and mismatch[0]["where"].startswith(
        "diffusers/models/transformers/transformer_wan.py:"
    )
    assert f"warned at {bench['warnings'][0]['where']}" in rows["bench-cpu"]

    machine = {"gpus": 0, "device_name": "cpu"}
    document = json.loads(json.dumps(summary(results, machine)))
    assert document["machine"] == machine and document["passed"] is False
    assert [s["name"] for s in document["steps"]] == list(rows)
    assert document["steps"][0]["figures"]["trainer_ms"] == bench["trainer"]["median_ms"]
    assert summary([r for r in results if r.status != "failed"], machine)["passed"] is True


def test_a_step_that_overruns_is_stopped_and_failed(tmp_path):
    step = Step("sleepy", "a step that hangs", ("-c", "import time; time.sleep(30)"), "bench", "none.json")
    result = run_step(step, tmp_path, timeout_s=1)
    assert isinstance(result, StepResult) and result.status == "failed" and "stopped after 1 s" in result.note
    assert result.seconds < 20


def test_a_model_alone_row_reads_its_step_and_the_sdpa_kernel(tmp_path):
    """The LoRA and teacher rows come from distill.bench.model_step's JSON: a step, no trainer."""
    from distill.bench.run import run_bench
    from distill.bench.settings import SMALL_EXPERT, BenchSettings

    tiny = {**SMALL_EXPERT, "num_layers": 1, "num_attention_heads": 2, "ffn_dim": 32, "text_dim": 16}
    settings = BenchSettings(
        preset="t", teacher=tiny, workload="teacher", batch_size=1, text_len=8, steps=1, warmup=0
    )
    path = tmp_path / "teacher.json"
    path.write_text(json.dumps(run_bench(settings)))
    figures = gpu_check.read_bench(path)
    assert figures["step_ms"] > 0 and figures["mfu"] is None and figures["sdpa_kernel"] is None
    assert gpu_check.describe({**figures, "sdpa_kernel": "cudnn"}).startswith(
        f"step {figures['step_ms']:.1f} ms"
    )
    assert "SDPA kernel cudnn" in gpu_check.describe({**figures, "sdpa_kernel": "cudnn"})
