"""The causal student kind (distill/models/causal/attention.py) on the tiny teacher's high-noise expert,
a real WanTransformer3DModel in float32: block-causal attention over chunks of latent frames, set
through diffusers' processor interface on an unchanged model, saved and loaded as a diffusers model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from distill.models.attention_backend import apply_backend
from distill.models.causal.attention import ChunkCausalProcessor, causal_layout, make_causal
from distill.models.causal.layout import CAUSAL_FILE, read_causal_config
from distill.models.student import export_student
from distill.models.teacher import inspect_teacher, load_expert
from distill.ops.errors import DistillError
from distill.sample.student_folder import load_student

# One latent frame is (16, 8, 8) -> 16 tokens; 6 frames are 2 chunks of 3 or 6 chunks of 1.
FRAMES = 6


def inputs(seed: int = 0, frames: int = FRAMES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, frames, 8, 8, generator=generator), torch.randn(1, 7, 32, generator=generator)


@torch.no_grad()
def run(
    model: WanTransformer3DModel, latents: torch.Tensor, text: torch.Tensor, t: float = 900.0
) -> torch.Tensor:
    return model(latents, torch.tensor([t]), text, return_dict=False)[0]


def fresh(tiny_teacher: Path) -> WanTransformer3DModel:
    return load_expert(inspect_teacher(str(tiny_teacher)), "transformer", torch.float32)


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_chunk_does_not_see_later_frames_but_later_chunks_see_it(tiny_teacher: Path, chunk: int) -> None:
    model = make_causal(fresh(tiny_teacher), chunk)
    latents, text = inputs()
    base = run(model, latents, text)
    for changed in range(chunk, FRAMES, chunk):  # every chunk boundary
        later = latents.clone()
        later[:, :, changed:] += 1.0
        out = run(model, later, text)
        # Block-causal: chunks before the change are computed from exactly the same numbers.
        assert torch.equal(out[:, :, :changed], base[:, :, :changed])
        assert (out[:, :, changed:] - base[:, :, changed:]).abs().max() > 1e-2
    if chunk > 1:  # within a chunk attention stays bidirectional: its first frame sees its last one
        last = latents.clone()
        last[:, :, chunk - 1] += 1.0
        assert (run(model, last, text)[:, :, 0] - base[:, :, 0]).abs().max() > 1e-2


def test_one_chunk_over_the_clip_is_the_bidirectional_model(tiny_teacher: Path) -> None:
    """The processor computes what diffusers' own computes, the mask aside: a chunk as long as the
    clip attends to everything, and the output is the stock model's."""
    model = fresh(tiny_teacher)
    latents, text = inputs()
    stock = run(model, latents, text)
    causal = run(make_causal(model, FRAMES), latents, text)
    torch.testing.assert_close(causal, stock, rtol=0, atol=1e-6)
    assert (run(make_causal(model, 3), latents, text) - stock).abs().max() > 1e-2  # and it is causal


def test_weights_stay_a_wan_transformer_and_the_export_records_the_chunk(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    model = fresh(tiny_teacher)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    make_causal(model, 3)
    assert causal_layout(model).chunk_frames == 3
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    folder = export_student(model, tmp_path / "student")
    assert json.loads((folder / CAUSAL_FILE).read_text())["chunk_frames"] == 3
    # Stock diffusers loads it as a plain (bidirectional) WanTransformer3DModel, weights equal.
    plain = WanTransformer3DModel.from_pretrained(folder)
    assert causal_layout(plain) is None
    assert all(torch.equal(plain.state_dict()[k], before[k]) for k in before)
    # Our loader makes it causal again, and it computes what the exported model computed.
    info = inspect_teacher(str(tiny_teacher))
    loaded = load_student(folder, info, torch.device("cpu"), torch.float32)
    assert causal_layout(loaded).chunk_frames == 3
    latents, text = inputs(1)
    torch.testing.assert_close(run(loaded, latents, text), run(model, latents, text), rtol=0, atol=0)
    # A bidirectional export writes no record.
    assert not (export_student(fresh(tiny_teacher), tmp_path / "bi") / CAUSAL_FILE).exists()


def test_an_attention_backend_set_later_keeps_the_causal_processor(tiny_teacher: Path) -> None:
    model = make_causal(fresh(tiny_teacher), 3)
    latents, text = inputs()
    base = run(model, latents, text)
    apply_backend("native", model)
    processors = [block.attn1.processor for block in model.blocks]
    assert all(isinstance(p, ChunkCausalProcessor) and p._attention_backend == "native" for p in processors)
    torch.testing.assert_close(run(model, latents, text), base, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "3"])
def test_a_chunk_that_is_not_a_positive_whole_number_is_refused(
    tiny_teacher: Path, tmp_path: Path, bad: object
) -> None:
    with pytest.raises(DistillError, match="positive whole number") as caught:
        make_causal(fresh(tiny_teacher), bad)  # type: ignore[arg-type]
    assert "1 or 3" in caught.value.fixes[0]
    (tmp_path / CAUSAL_FILE).write_text(json.dumps({"chunk_frames": bad}))
    with pytest.raises(DistillError, match=CAUSAL_FILE):
        read_causal_config(tmp_path)
    (tmp_path / CAUSAL_FILE).write_text("{chunk_frames: 3")
    with pytest.raises(DistillError, match="cannot read"):
        read_causal_config(tmp_path)
