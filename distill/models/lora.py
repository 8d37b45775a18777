"""The student as the teacher's own experts with LoRA adapters, sharing one copy of their weights.

`--student_lora_rank R` makes the student the high- and low-noise experts themselves, each with a
"student" adapter (peft, through diffusers' adapter API), routed by timestep as the teacher is. The
teacher is the same experts with adapters disabled, and the dmd critic is either its own "critic"
adapters on them (`--critic_lora_rank`) or a full trainable copy of the experts. So the base
weights of the 2 x 14B experts exist once in memory however many roles use them.

A teacher with one transformer (TI2V-5B: no transformer_2, no boundary) is the same with one
expert: routing calls it "high" (`transformer`, as GuidedTeacher does) and hands it every sample,
its timestep one per token as the conditioning layer builds it; `experts` is then ("high",).

Which adapter an expert runs is set per call (`AdapterSwitch`). Two things make that safe:
- peft's `set_adapters` / `disable_adapters` also flip `requires_grad` (the active adapter trainable,
  the others frozen); the switch puts back `requires_grad=True` on every adapter this run trains;
- with gradient checkpointing an expert's blocks are recomputed during backward, after the teacher
  and the critic may have switched the expert to another adapter; a hook on each routed output
  switches the expert back to the adapter that produced it before backward enters its blocks.

LoRA B starts at zero, so a fresh student predicts exactly what the teacher's experts predict.

A causal LoRA student (distill/models/causal/experts.py): each expert attends block-causally while it
runs the student's adapter, and over the whole clip for the teacher and the critic (distill/models/causal).
A chunk's few steps cross the boundary, so each expert keeps its own keys and values of the finished
chunks: the pass that adds a clean chunk to the KV cache runs every expert (`each_expert`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distill.config.settings import LORA_TARGETS as DEFAULT_TARGETS
from distill.config.settings import canonical_lora_targets
from distill.models.flow_matching import high_noise_mask
from distill.models.lockstep import placeholder_inputs, split_degree
from distill.ops.distributed import any_rank

EXPERTS = ("high", "low")  # transformer (t >= boundary), transformer_2
ONE_EXPERT = ("high",)  # the one transformer of a teacher without a boundary: `transformer`
STUDENT_ADAPTER = "student"
CRITIC_ADAPTER = "critic"


@dataclass(frozen=True)
class LoraShape:
    """Rank, alpha and target modules of one adapter set (the scale is alpha / rank)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        # One spelling per set of modules: adapters written with the targets in another order (or
        # a name twice) are the same shape, and compare equal to this run's.
        object.__setattr__(self, "targets", canonical_lora_targets(self.targets))

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            init_lora_weights="gaussian",  # A random, B zero: the adapter starts as a no-op
        )


@contextlib.contextmanager
def stacking_adapters() -> Iterator[None]:
    """Adapters added inside join those already there on purpose: peft's warning that a model now
    holds several adapters ("Already found a `peft_config` attribute") is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        yield


def add_adapter(expert: nn.Module, name: str, shape: LoraShape, seed: int) -> list[nn.Parameter]:
    """Add adapter `name` to `expert` (frozen base, float32 adapter weights, seeded) and return its parameters."""
    expert.requires_grad_(False)
    with stacking_adapters(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        expert.add_adapter(shape.peft_config(), adapter_name=name)
    params = adapter_parameters(expert, name)
    if not params:
        raise ValueError(f"no module of the expert matches the LoRA targets {', '.join(shape.targets)}")
    for p in params:
        p.data = p.data.float()  # adapters train in float32 whatever the base dtype
        p.requires_grad_(True)
    return params


def adapter_parameters(expert: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters of adapter `name` in `expert`, in module order."""
    return [p for key, p in expert.named_parameters() if f".{name}." in key and ".lora_" in key]


def adapter_state(expert: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name` as diffusers names its keys (`blocks.0.attn1.to_q.lora_A.weight`)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(expert, adapter_name=name).items()}


class AdapterSwitch:
    """Which adapter one expert runs (None: none, the teacher), switched only when it changes."""

    def __init__(self, expert: nn.Module) -> None:
        self.expert = expert
        self.trained: list[nn.Parameter] = []  # adapter parameters some optimizer updates
        self.active: str | None | bool = False  # False: not known yet

    def use(self, name: str | None) -> None:
        if name == self.active:
            return
        if name is None:
            self.expert.disable_adapters()
        else:
            self.expert.enable_adapters()
            self.expert.set_adapters(name)
        # peft made the active adapter trainable and froze the others: what trains is this run's
        # choice (an adapter kept frozen, e.g. the distilled high-noise one, stays frozen).
        trained = {id(p) for p in self.trained}
        for key, p in self.expert.named_parameters():
            if ".lora_" in key:
                p.requires_grad_(id(p) in trained)
        self.active = name


class ExpertView(nn.Module):
    """An expert as one role sees it: calling it runs the expert with that role's adapter (None: the
    teacher, adapters off). A module, so WanPipeline and the teacher's code take it for the expert."""

    def __init__(self, switch: AdapterSwitch, adapter: str | None) -> None:
        super().__init__()
        self.expert = switch.expert
        object.__setattr__(self, "switch", switch)
        self.adapter = adapter

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.switch.use(self.adapter)
        return self.expert(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # config, dtype, device, cache_context... of the expert
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["expert"], name)


def route(
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    boundary_ratio: float | None,
    call: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    lockstep: bool = False,
    patch_size: Sequence[int] = (1, 2, 2),
    split: int = 1,
) -> torch.Tensor:
    """Run each sample through the expert of its timestep (`call(which, x, t, text)`), in batch order.

    `lockstep` (experts sharded over the ranks, whose forward and backward gather weights from every
    rank): whenever any rank runs an expert, every rank does, in the same order, a rank without a
    sample for it on a placeholder of one token (distill/models/lockstep.py, `patch_size` the
    experts'), or of a multiple of `split` tokens when the experts are split over a context group.
    The placeholder's output joins the result times zero, so backward also passes through that
    expert on every rank, with zero gradient.

    No boundary (one transformer): the whole batch goes to "high" as it is, whatever the timestep's
    shape (TI2V-5B's is one per token, (B, tokens)); every rank runs it on every call, so lockstep
    needs no placeholder. With a boundary, a timestep per token (B, tokens) routes each sample whole,
    and a sample whose tokens lie on both sides of the boundary is refused: one forward of one
    expert cannot hold it."""
    if boundary_ratio is None:
        return call("high", hidden_states, timestep, encoder_hidden_states)
    is_high = high_noise_mask(timestep.detach().cpu(), boundary_ratio)
    if is_high.dim() > 1:
        if not torch.equal(is_high.all(dim=1), is_high.any(dim=1)):
            raise ValueError(
                "a sample's tokens have timesteps on both sides of the experts' boundary "
                f"({boundary_ratio * 1000:g}): no one expert can run it"
            )
        is_high = is_high.all(dim=1)
    parts, rows_of_parts, placeholders = [], [], []
    for which, mask in (("high", is_high), ("low", ~is_high)):
        rows = mask.nonzero().flatten()
        present = rows.numel() > 0
        if lockstep:
            present = any_rank(present, hidden_states.device)
        if not present:
            continue
        if rows.numel() == 0:
            inputs = placeholder_inputs(hidden_states, timestep, encoder_hidden_states, patch_size, split)
            placeholders.append(call(which, *inputs))
            continue
        index = rows.to(hidden_states.device)
        parts.append(
            call(
                which,
                hidden_states.index_select(0, index),
                timestep.index_select(0, rows.to(timestep.device)),
                encoder_hidden_states.index_select(0, index),
            )
        )
        rows_of_parts.append(rows)
    out = torch.cat(parts)
    if len(parts) > 1:  # back to batch order
        order = torch.cat(rows_of_parts).argsort()
        out = out.index_select(0, order.to(out.device))
    for placeholder in placeholders:
        out = out + placeholder.float().sum().to(out.dtype) * 0
    return out


class RoutedModel(nn.Module):
    """Base of a trained model made of the teacher's experts routed by timestep (two, or one with no
    boundary), called like one Wan transformer."""

    boundary_ratio: float | None
    experts: tuple[str, ...] = EXPERTS  # ONE_EXPERT for a teacher with one transformer
    lockstep: bool = False  # True when the experts are sharded over the ranks (see `route`)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor]:
        def call(which: str, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            return self.run_expert(which, x, t, text, **kwargs)

        return (
            route(
                hidden_states,
                timestep,
                encoder_hidden_states,
                self.boundary_ratio,
                call,
                self.lockstep,
                tuple(self.config.patch_size),
                split_degree(self.expert("high")),
            ),
        )

    def run_expert(
        self, which: str, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        raise NotImplementedError

    def expert(self, which: str) -> nn.Module:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.expert("high").dtype

    @property
    def config(self) -> Any:
        return self.expert("high").config

    @property
    def device(self) -> torch.device:
        return self.expert("high").device

    def enable_gradient_checkpointing(self) -> None:
        """diffusers' own on each expert (distill.models.causal.attention.enable_checkpointing gives
        a causal LoRA student's experts theirs)."""
        for which in self.experts:
            self.expert(which).enable_gradient_checkpointing()

    def routed_experts(self) -> tuple[nn.Module, ...]:
        """The expert modules this model routes to, in `experts` order (distill/models/causal finds a
        causal LoRA student's experts through it: they are not submodules of an AdapterModel)."""
        return tuple(self.expert(which) for which in self.experts)

    def each_expert(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor]:
        """Every expert on the whole batch, whatever the timestep (the last one's output): the pass
        that adds a clean chunk to a causal student's KV cache, whose keys each expert keeps for its
        own later steps. In the same order on every rank, as sharded experts need."""
        out = None
        for which in self.experts:
            out = self.run_expert(which, hidden_states, timestep, encoder_hidden_states, **kwargs)
        assert out is not None
        return (out,)

    def sampling_experts(self) -> tuple[nn.Module, nn.Module | None]:
        """(high, low) as plain modules running this model's weights, for WanPipeline (they keep
        running them until another role switches them); low None with one transformer."""
        return self.expert("high"), self.expert("low") if "low" in self.experts else None


class AdapterModel(RoutedModel):
    """One role's adapters (student or critic) on the shared experts. Its parameters are the adapters'
    only, so optimizers, EMA, DDP and checkpoints see nothing of the base weights."""

    def __init__(
        self,
        switches: dict[str, AdapterSwitch],
        adapter: str,
        boundary_ratio: float | None,
        trained: Sequence[str] = EXPERTS,
    ) -> None:
        super().__init__()
        self.adapter, self.boundary_ratio = adapter, boundary_ratio
        self.experts = tuple(which for which in EXPERTS if which in switches)
        self.trained_experts = tuple(which for which in trained if which in switches)
        object.__setattr__(self, "switches", switches)  # not submodules: the base weights stay out
        self.adapters = nn.ParameterDict()
        for which in self.trained_experts:
            expert = switches[which].expert
            for key, p in expert.named_parameters():
                if f".{adapter}." in key and ".lora_" in key:
                    self.adapters[f"{which}__{key.replace('.', '__')}"] = p
            switches[which].trained.extend(adapter_parameters(expert, adapter))
        for p in self.adapters.values():
            p.requires_grad_(True)  # switching experts earlier (the teacher's turn) may have frozen them

    def expert(self, which: str) -> nn.Module:
        return self.switches[which].expert

    def run_expert(
        self, which: str, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        switch = self.switches[which]
        switch.use(self.adapter)
        expert = switch.expert
        out = expert(
            hidden_states=x.to(expert.dtype),
            timestep=t,
            encoder_hidden_states=text.to(expert.dtype),
            return_dict=False,
            **kwargs,
        )[0]
        if out.requires_grad:
            # Backward may recompute this expert's blocks (gradient checkpointing) after another role
            # switched it: switch back first. The hook runs before autograd enters the expert.
            out.register_hook(lambda grad: (switch.use(self.adapter), grad)[1])
        return out

    def state(self, which: str) -> dict[str, torch.Tensor]:
        """This role's adapter on expert `which`, in diffusers' key names."""
        return adapter_state(self.expert(which), self.adapter)

    def sampling_experts(self) -> tuple[nn.Module, nn.Module | None]:
        for which in self.experts:
            self.switches[which].use(self.adapter)
        return super().sampling_experts()


class ExpertCopies(RoutedModel):
    """A full trainable copy of the experts (the dmd critic without adapters, as published recipes
    train it): both, or the one transformer (`low` and `boundary_ratio` None)."""

    def __init__(self, high: nn.Module, low: nn.Module | None, boundary_ratio: float | None) -> None:
        super().__init__()
        self.high, self.low = high, low
        self.boundary_ratio = boundary_ratio
        self.experts = EXPERTS if low is not None else ONE_EXPERT
        for model in (high, low):
            if model is not None:
                model.requires_grad_(True)

    def expert(self, which: str) -> nn.Module:
        return self.high if which == "high" else self.low

    def run_expert(
        self, which: str, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        expert = self.expert(which)
        return expert(
            hidden_states=x.to(expert.dtype),
            timestep=t,
            encoder_hidden_states=text.to(expert.dtype),
            return_dict=False,
            **kwargs,
        )[0]


class LoraExperts:
    """The experts of one run (two, or the one transformer of a teacher without a boundary: `low`
    None) with every role's adapters: the student's, and the dmd critic's when it trains adapters
    too. Hands out each role's view of the same experts."""

    def __init__(
        self,
        high: nn.Module,
        low: nn.Module | None,
        student: LoraShape,
        critic: LoraShape | None,
        seed: int,
    ) -> None:
        self.experts = EXPERTS if low is not None else ONE_EXPERT
        self.switches = {which: AdapterSwitch(m) for which, m in zip(EXPERTS, (high, low)) if m is not None}
        self.shapes = {STUDENT_ADAPTER: student, **({CRITIC_ADAPTER: critic} if critic else {})}
        for offset, (name, shape) in enumerate(self.shapes.items()):
            for index, which in enumerate(self.experts):
                add_adapter(self.switches[which].expert, name, shape, seed + 1000 * offset + index)

    def load(self, adapter: str, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Put trained weights (diffusers key names, per expert) into adapter `adapter`."""
        from peft.utils import set_peft_model_state_dict

        if set(states) != set(self.experts):
            raise ValueError(
                f"adapters for experts {sorted(states)} given to a teacher with experts {list(self.experts)}"
            )
        for which, state in states.items():
            expert = self.switches[which].expert
            result = set_peft_model_state_dict(expert, state, adapter_name=adapter)
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"{which}-noise adapter: keys the expert has no place for: {unexpected[:3]}")

    def model(
        self, adapter: str, boundary_ratio: float | None, trained: Sequence[str] = EXPERTS
    ) -> AdapterModel:
        """Role `adapter` as one model; only the adapters of the `trained` experts are its parameters
        (the others run frozen, e.g. the distilled high-noise adapter while the low-noise one trains).
        Names of experts the teacher lacks are ignored (both = the one transformer's)."""
        if not any(which in self.experts for which in trained):
            raise ValueError(f"none of the experts {list(trained)} is the teacher's ({list(self.experts)})")
        for which in self.experts:
            if which not in trained:
                for p in adapter_parameters(self.switches[which].expert, adapter):
                    p.requires_grad_(False)
        return AdapterModel(self.switches, adapter, boundary_ratio, trained)

    def teacher_views(self) -> tuple[ExpertView, ExpertView | None]:
        """(high, low) with adapters off (low None with one transformer), for GuidedTeacher."""
        low = ExpertView(self.switches["low"], None) if "low" in self.switches else None
        return ExpertView(self.switches["high"], None), low

    def teacher_mode(self) -> None:
        """Adapters off on both experts (for code that calls the experts directly)."""
        for switch in self.switches.values():
            switch.use(None)


def target_sizes(expert_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target linear of an expert, from its config alone."""
    width = expert_config["num_attention_heads"] * expert_config["attention_head_dim"]
    ffn = expert_config["ffn_dim"]
    return {
        "to_q": (width, width),
        "to_k": (width, width),
        "to_v": (width, width),
        "to_out.0": (width, width),
        "ffn.net.0.proj": (width, ffn),
        "ffn.net.2": (ffn, width),
    }


def count_adapter_parameters(expert_config: dict[str, Any], shape: LoraShape) -> int:
    """Parameters of one adapter set on one expert, from the config alone (for the memory plan)."""
    sizes = target_sizes(expert_config)
    per_block = 0
    for target in shape.targets:
        fan_in, fan_out = sizes[target]
        attention = target.startswith("to_")
        # Attention targets exist in attn1 and attn2; cross-attention's k/v read the text after the
        # model projected it to its own width, so every attention linear is width x width.
        per_block += shape.rank * (fan_in + fan_out) * (2 if attention else 1)
    return per_block * expert_config["num_layers"]
