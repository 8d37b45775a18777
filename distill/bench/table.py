"""The benchmark's result as a table for the terminal."""

from __future__ import annotations

from typing import Any


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_table(result: dict[str, Any]) -> str:
    s, env, models = result["settings"], result["environment"], result["models"]
    teacher, student = models["teacher_expert"], models["student"]
    steps = result["steps"]
    lines = [
        f"distill.bench  preset {result['preset']}  {env['device_name']} ({env['device']}, {env['threads']} threads)"
        f"  torch {env['torch']}  diffusers {env['diffusers']}",
        f"teacher  2 experts x {teacher['layers']} layers, {teacher['heads']}x{teacher['head_dim']} heads, "
        f"ffn {teacher['ffn_dim']}, {human_count(teacher['params'])} params each, {s['dtype']}"
        + (", streamed from CPU" if s["teacher_on_cpu"] and env["device"].startswith("cuda") else ""),
        f"student  {student['layers']} layers, {student['heads']}x{student['head_dim']} heads, ffn {student['ffn_dim']}, "
        f"{human_count(student['params'])} params, float32 weights"
        + (", bf16 autocast" if s["dtype"] == "bfloat16" else "")
        + (", grad checkpointing" if s["gradient_checkpointing"] else "")
        + (", compiled" if s["compile"] else ""),
        f"batch {s['batch_size']} x {models['tokens_per_sample']} tokens ({s['num_frames']} frame(s) "
        f"{s['height']}x{s['width']}, latent {'x'.join(map(str, models['latent_shape']))}), "
        f"text {models['text_len']} tokens",
        (
            f"method dmd: one bench step = one cycle of {s['critic_updates']} train_step calls (a generator "
            f"update and {s['critic_updates']} critic updates), student {s['student_steps']} steps, "
            "critic of the student's shape"
            if result["method"] == "dmd"
            else "method velocity"
        ),
        f"timed {steps['timed_trainer']} trainer + {steps['timed_bare']} bare steps in alternating blocks of "
        f"{steps['block']} after {steps['warmup']} warm-up; {steps['instrumented']} instrumented steps; "
        f"{steps['skipped_by_trainer']} skipped",
        "",
        f"{'step time':<34}{'median ms':>10}{'p10':>10}{'p90':>10}{'steps/s':>10}{'samples/s':>11}",
    ]
    for label, key in (("trainer (TrainingLoop.train_step)", "trainer"), ("bare loop", "bare")):
        r = result[key]
        lines.append(
            f"{label:<34}{r['median_ms']:>10.2f}{r['p10_ms']:>10.2f}{r['p90_ms']:>10.2f}"
            f"{r['steps_per_s']:>10.2f}{r['samples_per_s']:>11.2f}"
        )
    lines += [f"overhead ratio (median trainer / median bare): {result['overhead_ratio']:.3f}", ""]
    lines.append(f"{'phase (instrumented, synced)':<34}{'median ms':>10}{'p10':>10}{'p90':>10}{'share':>10}")
    phases = result["phases_ms"]
    for name, values in phases.items():
        share = values["median"] / phases["step"]["median"]
        lines.append(
            f"{name.replace('_', ' '):<34}{values['median']:>10.2f}{values['p10']:>10.2f}{values['p90']:>10.2f}"
            f"{share:>10.1%}"
        )
    memory, floor = result["memory"], result["memory"]["floor"]
    lines += [
        "",
        f"memory floor {human_bytes(memory['floor_bytes'])} on {env['device']}: student params "
        f"{human_bytes(floor['student_params'])} + grads {human_bytes(floor['student_grads'])} + AdamW state "
        f"{human_bytes(floor['optimizer_state'])} + teacher {human_bytes(floor['teacher_weights'])} "
        f"(on {floor['teacher_placement']})"
        + (
            f" + critic {human_bytes(floor['critic_params'])} + grads {human_bytes(floor['critic_grads'])} "
            f"+ AdamW state {human_bytes(floor['critic_optimizer_state'])}"
            if "critic_params" in floor
            else ""
        ),
        f"peak: CPU RSS {human_bytes(memory['cpu_rss_peak_bytes'])}"
        + (
            f", CUDA max allocated {human_bytes(memory['cuda_max_allocated_bytes'])}, "
            f"reserved {human_bytes(memory['cuda_max_reserved_bytes'])}"
            if memory["cuda_max_allocated_bytes"] is not None
            else ""
        ),
    ]
    flops = result["flops"]
    line = (
        f"model FLOPs per step {human_count(flops['per_step'])} (teacher {human_count(flops['teacher_per_step'])}, "
        f"student {human_count(flops['student_per_step'])}), achieved {flops['achieved_per_s'] / 1e12:.3f} TFLOP/s"
    )
    if flops["mfu"] is not None:
        line += f", MFU {flops['mfu']:.1%} of {flops['peak_per_s'] / 1e12:.0f} TFLOP/s"
    lines.append(line)
    placement = result["teacher_on_cpu"]
    if placement:
        lines.append(
            f"teacher forward streamed from CPU {placement['streamed_ms']['median']:.1f} ms vs GPU-resident "
            f"{placement['resident_ms']['median']:.1f} ms: {placement['slowdown']:.2f}x"
        )
    lines.append(f"wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)
