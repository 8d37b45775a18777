"""A user's LoRA of the toy teacher: the palette of distill.toy.user_world, in the Wan/ComfyUI format.

    python -m distill.toy.user_lora --retrain     # assets/toy_user_lora/ (about 2 min on one core)

What a user downloads for Wan 2.2 A14B: a high/low pair of `.safetensors` files with Wan's keys
(`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.lora_up.weight`, an `.alpha` per module).
It is trained as the toy teacher's experts were (distill.toy.expert_training: flow matching with
WanPipeline's conventions, each expert on its side of the boundary, prompts dropped to the empty one
now and then so guidance still has something to push against), but only adapters train, on pictures
of the user's world; the teacher stays as shipped. The folder is a `--teacher_lora` pair as it is.
Its record (RECORD_FILE) holds the command, the recipe, and what the teacher draws with and without it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.paths import Kind

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "assets" / "toy_user_lora"
FILES = {"high": "toy_palette_high_noise.safetensors", "low": "toy_palette_low_noise.safetensors"}
"""The pair's file names: `high` / `low` in the name put each on its expert (--teacher_lora's rule)."""
RECORD_FILE = "toy_user_lora.json"
REBUILD = "python -m distill.toy.user_lora --retrain"


@dataclass(frozen=True)
class UserLoraRecipe:
    """Everything that decides the user LoRA's weights (recorded with it)."""

    rank: int = 8
    alpha: float = 8.0
    steps: int = 800
    batch: int = 64
    """Pictures per step and expert."""
    lr: float = 2e-3
    pictures: int = 4096
    """User-world pictures encoded once."""
    seed: int = 0


def train_user_lora(teacher: str | Path, recipe: UserLoraRecipe, log: Any = print) -> dict[str, dict]:
    """The palette LoRA of the toy teacher in `teacher`: {"high": state, "low": state}, each in diffusers'
    adapter key names (`blocks.0.attn1.to_q.lora_A.weight`)."""
    from distill.models.lora import LoraShape, adapter_state, add_adapter
    from distill.toy.build import encode_texts
    from distill.toy.evaluation import load_experts, load_parts
    from distill.toy.expert_training import train_experts
    from distill.toy.recipe import Recipe
    from distill.toy.text_padding import fold_padding
    from distill.toy.user_world import sample_user_scenes
    from distill.toy.vae_fit import encode_pictures
    from distill.toy.world import all_prompts, read_world

    description = read_world(teacher) or {}
    parts = load_parts(teacher)
    high, low = load_experts(teacher)
    shape = LoraShape(recipe.rank, recipe.alpha)
    for offset, expert in enumerate((high, low)):
        add_adapter(expert, "user", shape, seed=recipe.seed * 100 + offset)
    prompts, scenes = sample_user_scenes(recipe.pictures, seed=recipe.seed * 7919 + 11)
    size = int(description.get("height", 32))
    latents = encode_pictures(parts["vae"], scenes, size)
    world_prompts = all_prompts()
    table = encode_texts(parts["tokenizer"], parts["text_encoder"], [*world_prompts, ""])
    lengths = [int(n) for n in parts["tokenizer"]([*world_prompts, ""], return_length=True)["length"]]
    index = {p: i for i, p in enumerate(world_prompts)}
    data = [(latents, torch.tensor([index[p] for p in prompts]), recipe.batch)]
    settings = (description.get("recipe") or {}) | {
        "seed": recipe.seed,
        "expert_steps": recipe.steps,
        "expert_lr": recipe.lr,
        "expert_batch": recipe.batch,
        "trained_experts": ("high", "low"),
        "low_focus": 0.0,
    }
    known = Recipe.__dataclass_fields__
    training = Recipe(
        **{k: (tuple(v) if isinstance(v, list) else v) for k, v in settings.items() if k in known}
    )
    train_experts(high, low, data, fold_padding(table, lengths), training, log, adapters_only=True)
    return {"high": adapter_state(high, "user"), "low": adapter_state(low, "user")}


def write_user_lora(states: dict[str, dict], recipe: UserLoraRecipe, out_dir: Path) -> Path:
    """The pair in Wan's keys (FILES), each checked by reading it back with diffusers' own converter."""
    from distill.models.lora import LoraShape
    from distill.models.lora_files import save_wan_format

    shape = LoraShape(recipe.rank, recipe.alpha)
    out_dir.mkdir(parents=True, exist_ok=True)
    for which, state in states.items():
        plain = {k: v.detach().float().contiguous() for k, v in state.items()}
        save_wan_format(
            plain,
            shape,
            out_dir / FILES[which],
            f"the toy user LoRA's {which}-noise file",
            "report this with the diffusers version installed",
        )
    return out_dir


def teacher_scores(teacher: str | Path, lora: Path | None, count: int | None = None) -> dict[str, float]:
    """The toy teacher (with `lora` fused at scale 1, or bare) at its full steps and guidance, on the
    world's scored prompts, scored in the user's world and in the base world."""
    from distill.toy.evaluation import eval_prompts, load_parts, sample_pictures, score_pictures
    from distill.toy.user_stack import stacked_experts
    from distill.toy.user_world import score_user
    from distill.toy.world import guidance_of, read_world

    description = read_world(teacher) or {}
    guidance = guidance_of(description)
    prompts = eval_prompts(count) if count else eval_prompts()
    high, low = stacked_experts(teacher, [] if lora is None else [("user", lora)])
    pictures = sample_pictures(
        teacher,
        prompts,
        transformer=high,
        transformer_2=low,
        steps=int(description.get("sample_steps", 20)),
        guidance_scale=guidance[0],
        guidance_scale_2=guidance[1],
        parts=load_parts(teacher),
    )
    return {
        "user_world": score_user(pictures, prompts)["accuracy"],
        "base_world": score_pictures(pictures, prompts)["accuracy"],
    }


def retrain(work: Path, recipe: UserLoraRecipe, dest: Path, log: Any = print) -> dict[str, Any]:
    """Train the pair on the shipped toy teacher, score the teacher with and without it, and ship it to
    `dest` with its record (all or nothing)."""
    from distill.toy.shipped import staged_folder, write_toy_teacher

    teacher = write_toy_teacher(work / "teacher", overwrite=True)
    start = time.perf_counter()
    states = train_user_lora(teacher, recipe, log)
    seconds = round(time.perf_counter() - start)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(dest) as staging:
        write_user_lora(states, recipe, staging)
        record = {
            "command": REBUILD,
            "recipe": asdict(recipe),
            "files": dict(FILES),
            "train_seconds": seconds,
            "teacher_20_steps": {
                "with_lora": teacher_scores(teacher, staging),
                "without": teacher_scores(teacher, None),
            },
        }
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.user_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train the pair again and ship it")
    parser.add_argument(
        "--work_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="where the toy teacher is copied (default outputs/toy-user-lora-work)",
    )
    parser.add_argument(
        "--output", action=PathAction, kind=Kind.OUTPUT_FOLDER, help=f"where it is shipped (default {ASSET})"
    )
    args = parser.parse_args(argv)
    if not args.retrain:
        parser.error("pass --retrain to train the toy user LoRA again (it replaces the --output folder)")
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    work = Path(args.work_dir or "outputs/toy-user-lora-work").absolute()
    dest = Path(args.output).absolute() if args.output else ASSET
    record = retrain(work, UserLoraRecipe(), dest)
    print(dest)
    print(json.dumps(record["teacher_20_steps"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
