"""Run under torchrun by tests/test_sharding.py: sharded vs whole experts, same results, and what a
rank without a sample for an expert runs to keep the gathers in step (one token, not a sample).

torchrun --standalone --nproc_per_node=2 tests/shard_velocity_check.py TEACHER_DIR

Prints one line per check and rank; exits 1 if any check fails.
"""

import sys

import torch

from distill.models.guided_teacher import GuidedTeacher
from distill.models.lora import STUDENT_ADAPTER, LoraExperts, LoraShape
from distill.models.teacher import inspect_teacher, load_expert, place_expert
from distill.ops import distributed

EXPERTS = ("transformer", "transformer_2")


def count_tokens(*models: torch.nn.Module) -> tuple[list[int], list]:
    """Tokens each model's forwards see (batch x latent frames x patches), via forward pre-hooks."""
    seen = [0] * len(models)

    def hook_for(index: int, patch: tuple[int, int, int]):
        def hook(_module, _args, kwargs):
            b, _, f, h, w = kwargs["hidden_states"].shape
            seen[index] += b * (f // patch[0]) * (h // patch[1]) * (w // patch[2])

        return hook

    handles = [
        m.register_forward_pre_hook(hook_for(i, tuple(m.config.patch_size)), with_kwargs=True)
        for i, m in enumerate(models)
    ]
    return seen, handles


def check_teacher(info, ctx, x, t, cond, uncond) -> bool:
    experts = {name: load_expert(info, name, torch.float32) for name in EXPERTS}
    whole = GuidedTeacher(
        experts["transformer"],
        experts["transformer_2"],
        info.boundary_ratio,
        4.0,
        3.0,
        ctx.device,
        torch.float32,
    )
    sharded_experts = [
        place_expert(load_expert(info, name, torch.float32), ctx.device, False, ctx.world_size)
        for name in EXPERTS
    ]
    sharded = GuidedTeacher(
        *sharded_experts, info.boundary_ratio, 4.0, 3.0, ctx.device, torch.float32, lockstep=True
    )
    seen, handles = count_tokens(*sharded_experts)
    ours = sharded.velocity(x, t, cond, uncond, (True, True))
    for handle in handles:
        handle.remove()
    worst = (ours - whole.velocity(x, t, cond, uncond)).abs().max().item()
    print(f"rank {ctx.rank} max abs difference {worst:.3e}", flush=True)
    print(f"rank {ctx.rank} teacher tokens high {seen[0]} low {seen[1]}", flush=True)
    return worst < 1e-5


def lora_experts(info, shard_over: int, device: torch.device) -> LoraExperts:
    high, low = (load_expert(info, name, torch.float32) for name in EXPERTS)
    lora = LoraExperts(high, low, LoraShape(4, 4.0, ("to_q", "to_v")), None, seed=0)
    # Adapters start at zero (a fresh student is the teacher): give them weights so gradients differ.
    with torch.no_grad():
        for switch in lora.switches.values():
            for name, p in switch.expert.named_parameters():
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    for which in ("high", "low"):
        switch = lora.switches[which]
        switch.expert = place_expert(switch.expert, device, False, shard_over)
    return lora


def check_lora(info, ctx, x, t, cond) -> bool:
    """The student's adapters on sharded experts, forward and backward, against whole experts."""
    results = []
    for shard_over in (ctx.world_size, 0):
        lora = lora_experts(info, shard_over, ctx.device)
        model = lora.model(STUDENT_ADAPTER, info.boundary_ratio)
        model.lockstep = shard_over > 1
        seen, handles = count_tokens(model.expert("high"), model.expert("low"))
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=cond)[0]
        out.float().pow(2).mean().backward()
        for handle in handles:
            handle.remove()
        # An expert no sample used gets no gradient from whole experts; zeros (from a placeholder) sharded.
        grads = {
            name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for name, p in model.adapters.items()
        }
        results.append((out.detach(), grads, list(seen)))
    (sharded_out, sharded_grads, seen), (whole_out, whole_grads, _) = results
    worst = (sharded_out - whole_out).abs().max().item()
    worst_grad = max((sharded_grads[k] - whole_grads[k]).abs().max().item() for k in whole_grads)
    print(f"rank {ctx.rank} lora max abs difference {worst:.3e} grad {worst_grad:.3e}", flush=True)
    print(f"rank {ctx.rank} lora tokens high {seen[0]} low {seen[1]}", flush=True)
    return worst < 1e-5 and worst_grad < 1e-5


def main() -> int:
    teacher_dir = sys.argv[1]
    ctx = distributed.setup("gloo", "cpu")
    info = inspect_teacher(teacher_dir)
    gen = torch.Generator().manual_seed(10 + ctx.rank)
    x = torch.randn(3, 16, 1, 4, 4, generator=gen)
    cond = torch.randn(3, 9, info.text_dim, generator=gen)
    uncond = torch.randn(1, 9, info.text_dim, generator=gen)
    # Rank 0 has samples for both experts, rank 1 only low-noise ones: it must still join the
    # high-noise expert's gathers (a one-token placeholder forward) or rank 0 would wait forever.
    t = torch.tensor([990.0, 100.0, 900.0]) if ctx.rank == 0 else torch.tensor([100.0, 300.0, 500.0])
    ok = check_teacher(info, ctx, x, t, cond, uncond)
    ok = check_lora(info, ctx, x, t, cond) and ok
    distributed.teardown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
