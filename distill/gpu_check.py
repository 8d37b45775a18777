"""`make gpu-check`: what CI cannot run, in one command on a CUDA machine, as one table and one JSON.

    python -m distill.gpu_check                       # or: make gpu-check
    python -m distill.gpu_check --output_dir outputs/gpu-check --only bench-eager --only bench-compiled

The steps, each in its own process (a crash or a full GPU in one cannot spoil the next):

- gpu-tests: `pytest -m gpu`, every test marked for a GPU (the two-GPU one is its own step);
- sharded-lora-nccl: the two-rank LoRA run with the experts sharded, on NCCL (two GPUs or more);
- bench-eager / bench-compiled: `python -m distill.bench --preset gpu-1.3b-pictures` (one frame),
  without and with --compile: step times, the trainer's overhead over a bare loop, MFU, peak memory;
- clip-eager / clip-compiled: the 1.3B student's step at 480x832x81 (gpu-1.3b-480p-81), the shape
  users train;
- lora-81: the A14B LoRA step, one whole expert with rank-64 adapters (gpu-a14b-lora-480p-81);
- teacher-81: the teacher's guided forward alone, one whole expert (gpu-teacher-480p-81);
- attention-NAME: the clip step under each attention backend that trains (--attention_backend
  _native_cudnn, _native_flash, flash, flex compiled); clip-eager is SDPA's own pick. A backend whose
  package is missing here is skipped, saying what to install;
- teacher-streamed-81: the clip step with the teacher held in CPU RAM (--teacher_on_cpu): a streamed
  teacher forward against a GPU-resident one on the same inputs.

It prints the table and writes <output_dir>/gpu_check.json (beside each step's log, bench JSON and
pytest report); exit code 0 when every step passed or was skipped, 1 otherwise. Without CUDA it
says so, writes nothing and exits 0: there is nothing here a CPU machine can check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distill.ops.command import Parser, PathAction, entry_point, number
from distill.ops.errors import DistillError, report
from distill.ops.files import atomic_write_text
from distill.ops.paths import Kind, PathFlag, check_paths

REPO = Path(__file__).resolve().parents[1]
RESULT_FILE = "gpu_check.json"
TWO_GPU_TEST = "tests/test_gpu_two_ranks.py"
NO_CUDA = "gpu-check: torch sees no CUDA device here, so there is nothing to check (exit 0, nothing written)."


@dataclass(frozen=True)
class Step:
    """One check: the command it runs (after the Python executable) and how its result is read."""

    name: str
    what: str
    args: tuple[str, ...]
    reads: str
    """"pytest" (a JUnit XML report) or "bench" (distill.bench's JSON)."""
    report_file: str
    """The file, in the output folder, that the command writes its result to."""
    gpus: int = 1
    backend: str | None = None
    """The attention backend the step runs: skipped where it cannot run (a missing package)."""


@dataclass
class StepResult:
    """What one step gave: passed, failed or skipped, how long it took, and its figures."""

    name: str
    what: str
    status: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def bench_step(name: str, what: str, *extra: str, preset: str = "gpu-1.3b-pictures") -> Step:
    file = f"{name}.json"
    args = ("-m", "distill.bench", "--preset", preset, *extra, "--json", file)
    backend = extra[extra.index("--attention_backend") + 1] if "--attention_backend" in extra else None
    return Step(name, what, args, "bench", file, backend=backend)


# The backends compared at 81 frames (SDPA's own pick is clip-eager). flex is compiled: eager, it
# materialises every score (tens of GB a block at 32,760 tokens).
BACKENDS = (("_native_cudnn",), ("_native_flash",), ("flash",), ("flex", "--compile"))
CLIP = "gpu-1.3b-480p-81"


def pytest_step(name: str, what: str, *selection: str, gpus: int = 1) -> Step:
    report_file = f"{name}.xml"
    # Absolute test paths: the step runs in the output folder, and pytest takes its settings
    # (markers, conftest.py) from the repository they point into.
    args = ("-m", "pytest", "-q", "-p", "no:cacheprovider", *selection, "--junitxml", report_file)
    return Step(name, what, args, "pytest", report_file, gpus)


def plan_steps(gpus: int) -> list[Step]:
    """The steps for a machine with `gpus` CUDA devices; those that need more are left out."""
    two_gpu_test = str(REPO / TWO_GPU_TEST)
    steps = [
        pytest_step("gpu-tests", "pytest -m gpu", "-m", "gpu", str(REPO / "tests"), "--ignore", two_gpu_test),
        pytest_step("sharded-lora-nccl", "two-rank LoRA, experts sharded, on NCCL", two_gpu_test, gpus=2),
        bench_step("bench-eager", "distill.bench gpu-1.3b, eager"),
        bench_step("bench-compiled", "distill.bench gpu-1.3b, --compile", "--compile"),
        # 81 frames at 480x832 is 32,760 tokens a sample: one sample, checkpointed, fits one GPU.
        bench_step("clip-eager", "1.3B student step, 480x832x81, eager", preset=CLIP),
        bench_step("clip-compiled", "1.3B student step, 480x832x81, --compile", "--compile", preset=CLIP),
        bench_step(
            "lora-81", "A14B LoRA step, whole expert, rank 64, 480x832x81", preset="gpu-a14b-lora-480p-81"
        ),
        bench_step("teacher-81", "A14B expert guided forward, 480x832x81", preset="gpu-teacher-480p-81"),
        *(
            bench_step(
                f"attention-{name.strip('_')}",
                f"1.3B student step, 480x832x81, --attention_backend {name}",
                "--attention_backend",
                name,
                *extra,
                preset=CLIP,
            )
            for name, *extra in BACKENDS
        ),
        bench_step(
            "teacher-streamed-81",
            "teacher streamed from CPU vs resident, 81 frames",
            "--teacher_on_cpu",
            preset=CLIP,
        ),
    ]
    return [step for step in steps if step.gpus <= gpus]


def unavailable(step: Step) -> str:
    """Why `step` cannot run on this machine's software ("" when it can): its backend's refusal."""
    if step.backend is None:
        return ""
    from distill.config.attention_backends import check_backend
    from distill.ops.errors import DistillError

    try:
        check_backend(step.backend, "cuda")
    except DistillError as error:
        return f"{error.title}: {'; '.join(error.fixes[:1])}"
    return ""


def skipped_steps(gpus: int) -> list[StepResult]:
    """The steps this machine has too few GPUs for, as results that say so."""
    run = {step.name for step in plan_steps(gpus)}
    return [
        StepResult(step.name, step.what, "skipped", note=f"needs {step.gpus} GPUs, this machine has {gpus}")
        for step in plan_steps(sys.maxsize)
        if step.name not in run
    ]


# ---------------------------------------------------------------------------------------------
# Running a step and reading what it wrote
# ---------------------------------------------------------------------------------------------


def run_step(step: Step, output_dir: Path, timeout_s: float) -> StepResult:
    """Run `step` in `output_dir` (where it writes its report); its output goes to <name>.log there."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    log = output_dir / f"{step.name}.log"
    (output_dir / step.report_file).unlink(missing_ok=True)  # a stale report must not pass as new
    started = time.perf_counter()
    code: int | None
    with log.open("w") as out:
        try:
            code = subprocess.run(
                [sys.executable, *step.args],
                cwd=output_dir,
                env={**os.environ, "PYTHONPATH": path},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    result = read_result(step, output_dir / step.report_file, code)
    result.seconds = time.perf_counter() - started
    if code is None:
        result.status, result.note = "failed", f"stopped after {timeout_s:.0f} s (--step_timeout)"
    elif result.status == "failed" and not result.note:
        result.note = f"exit code {code}; {log.name}: {last_line(log)}"
    return result


def read_result(step: Step, path: Path, code: int | None) -> StepResult:
    """The result of `step` from the report it wrote (absent when it failed before writing one)."""
    figures: dict[str, Any] = {}
    if path.is_file():
        figures = read_pytest(path) if step.reads == "pytest" else read_bench(path)
    if step.reads == "pytest" and figures and figures["passed"] == 0:
        # Everything skipped: nothing was checked, which on a GPU machine means the GPU was not seen.
        note = "no test ran (all skipped or deselected: do the tests see the GPU?)"
        return StepResult(step.name, step.what, "failed", figures=figures, note=note)
    passed = code == 0 and bool(figures)
    return StepResult(step.name, step.what, "passed" if passed else "failed", figures=figures)


def read_pytest(path: Path) -> dict[str, int]:
    """Counts from a pytest JUnit XML report."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def read_bench(path: Path) -> dict[str, Any]:
    """The figures a person compares between machines, from distill.bench's JSON."""
    result = json.loads(path.read_text())
    memory = result["memory"]
    if "step" in result:  # one model alone (distill.bench.model_step): no trainer to compare
        return {
            "device": result["environment"]["device_name"],
            "step_ms": result["step"]["median_ms"],
            "mfu": result["flops"]["mfu"],
            "peak_bytes": memory["cuda_max_allocated_bytes"] or memory["cpu_rss_peak_bytes"],
            "sdpa_kernel": result["environment"].get("sdpa_kernel"),
            "warnings": result.get("warnings", []),
        }
    figures = {
        "device": result["environment"]["device_name"],
        "sdpa_kernel": result["environment"].get("sdpa_kernel"),
        "trainer_ms": result["trainer"]["median_ms"],
        "bare_ms": result["bare"]["median_ms"],
        "overhead_ratio": result["overhead_ratio"],
        "mfu": result["flops"]["mfu"],
        "peak_bytes": memory["cuda_max_allocated_bytes"] or memory["cpu_rss_peak_bytes"],
        "warnings": result.get("warnings", []),
    }
    placement = result.get("teacher_on_cpu")
    if placement:
        figures |= {
            "streamed_ms": placement["streamed_ms"]["median"],
            "resident_ms": placement["resident_ms"]["median"],
            "streamed_slowdown": placement["slowdown"],
        }
    return figures


def last_line(log: Path) -> str:
    lines = (
        [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if log.is_file()
        else []
    )
    # A command that failed with the banner: its title says what, the banner's closing bar nothing.
    titles = [line for line in lines if line.lstrip().startswith("ERROR (")]
    return (titles or lines)[-1].strip()[:200] if lines else "(no output)"


# ---------------------------------------------------------------------------------------------
# The table and the JSON
# ---------------------------------------------------------------------------------------------


def describe(figures: dict[str, Any]) -> str:
    """One line of a step's figures, in the units people quote."""
    if "tests" in figures:
        return ", ".join(
            f"{figures[k]} {k}" for k in ("passed", "failures", "errors", "skipped") if figures[k]
        )
    parts = []
    if "streamed_ms" in figures:
        parts.append(
            f"streamed {figures['streamed_ms']:.1f} ms vs resident {figures['resident_ms']:.1f} ms "
            f"({figures['streamed_slowdown']:.1f}x)"
        )
    if "trainer_ms" in figures:
        parts.append(f"step {figures['trainer_ms']:.1f} ms (bare {figures['bare_ms']:.1f})")
        parts.append(f"overhead {figures['overhead_ratio']:.3f}")
    elif "step_ms" in figures:
        parts.append(f"step {figures['step_ms']:.1f} ms")
    if "trainer_ms" in figures or "step_ms" in figures:
        if figures["mfu"] is not None:
            parts.append(f"MFU {100 * figures['mfu']:.1f}%")
        parts.append(f"peak {figures['peak_bytes'] / 1e9:.1f} GB")
        if figures.get("sdpa_kernel"):
            parts.append(f"SDPA kernel {figures['sdpa_kernel']}")
    if figures.get("warnings"):  # a warning can be a slow path (distill/bench/warning_log.py)
        first = figures["warnings"][0]
        more = f" (+{len(figures['warnings']) - 1} more, in the JSON)" if len(figures["warnings"]) > 1 else ""
        parts.append(f"warned at {first['where']}: {first['message'][:60]}{more}")
    return ", ".join(parts)


def format_table(results: list[StepResult]) -> str:
    rows = [("step", "result", "time", "figures")]
    for r in results:
        detail = "; ".join(filter(None, [describe(r.figures), r.note]))
        rows.append((r.name, r.status, f"{r.seconds:.0f} s" if r.status != "skipped" else "-", detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [" | ".join([*(row[i].ljust(widths[i]) for i in range(3)), row[3]]).rstrip() for row in rows]
    lines.insert(1, "-+-".join(["-" * w for w in widths] + ["-" * 7]))
    return "\n".join(lines)


def summary(results: list[StepResult], machine: dict[str, Any]) -> dict[str, Any]:
    """What gpu_check.json holds: the machine, every step's result, and whether all of them passed."""
    return {
        "machine": machine,
        "passed": all(r.status != "failed" for r in results),
        "steps": [asdict(r) for r in results],
    }


def machine() -> dict[str, Any]:
    import torch

    return {
        "gpus": torch.cuda.device_count(),
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir",
        default="outputs/gpu-check",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="where the JSON, logs and reports go",
    )
    parser.add_argument("--only", action="append", help="run only this step (repeatable)")
    parser.add_argument(
        "--step_timeout", type=number(0.0, above=True), default=1800.0, help="seconds one step may take"
    )
    args = parser.parse_args(argv)
    names = {step.name for step in plan_steps(sys.maxsize)}
    unknown = set(args.only or ()) - names
    if unknown:
        parser.error(f"--only {', '.join(sorted(unknown))}: the steps are {', '.join(sorted(names))}")
    if args.step_timeout <= 0:
        parser.error(f"--step_timeout must be positive (seconds), got {args.step_timeout:g}")
    try:  # paths first, like every command: a wrong --output_dir is the same mistake on any machine
        check_paths([PathFlag("--output_dir", args.output_dir, Kind.OUTPUT_FOLDER)])
    except DistillError as error:
        return report(error)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    gpus = torch.cuda.device_count()
    output_dir = Path(args.output_dir).absolute()
    output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for step in plan_steps(gpus):
        if args.only and step.name not in args.only:
            continue
        why = unavailable(step)
        if why:
            results.append(StepResult(step.name, step.what, "skipped", note=why))
            continue
        print(f"gpu-check: {step.name} ({step.what}) ...", flush=True)
        results.append(run_step(step, output_dir, args.step_timeout))
    results += [r for r in skipped_steps(gpus) if not args.only or r.name in args.only]
    print(format_table(results))
    document = summary(results, machine())
    atomic_write_text(output_dir / RESULT_FILE, json.dumps(document, indent=2) + "\n")
    print(f"wrote {output_dir / RESULT_FILE}")
    return 0 if document["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
