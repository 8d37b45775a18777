"""A causal LoRA student: the teacher's own experts, block-causal while they run the student's adapters.

    from distill.models.causal.experts import make_student_causal
    make_student_causal(lora_experts, chunk_frames=3)   # before placement, sharding or the split

The experts stay the teacher (adapters off) and the critic's adapters too, so each is made causal
only while its AdapterSwitch has the student's adapter active: the attention processor asks it on
every forward, also when backward recomputes a checkpointed block (the switch is put back to the
adapter that made the output first: distill/models/lora.py). Each expert keeps its own entries in a
KV cache ("high", "low"): a chunk's few steps cross the boundary, and one expert's keys mean nothing
to the other's weights.
"""

from __future__ import annotations

from distill.models.causal.attention import make_causal
from distill.models.lora import STUDENT_ADAPTER, AdapterSwitch, LoraExperts


def make_student_causal(experts: LoraExperts, chunk_frames: int) -> None:
    """The student's adapters on `experts` causal over chunks of `chunk_frames` latent frames, in place."""

    def student_active(switch: AdapterSwitch) -> bool:
        return switch.active == STUDENT_ADAPTER

    for which, switch in experts.switches.items():
        make_causal(switch.expert, chunk_frames, when=lambda s=switch: student_active(s), name=which)
