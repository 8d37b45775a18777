"""Prompts are encoded on the tokens they need and zero-padded after: what WanPipeline's own 512-token
encoding gives, up to float rounding (UMT5 masks the padding)."""

from __future__ import annotations

import torch

from distill.models.pipelines import encode_on_needed_tokens, load_text_components

PROMPTS = ["a red square", "a slow blue bar moving left across a white background at the top right"]


def test_the_short_encoding_is_the_pipelines_512_token_one(tiny_teacher):
    from diffusers import WanPipeline

    tokenizer, encoder = load_text_components(tiny_teacher, torch.device("cpu"), torch.float32)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, scheduler=None, transformer=None)
    with torch.no_grad():
        full, full_negative = pipe.encode_prompt(
            PROMPTS, negative_prompt=["", ""], max_sequence_length=512, device="cpu"
        )
        short, short_negative = encode_on_needed_tokens(pipe, PROMPTS, 512, "cpu", negative=True)
        alone, none = encode_on_needed_tokens(pipe, PROMPTS[:1], 512, "cpu")
    assert short.shape == full.shape == (2, 512, full.shape[-1]) and none is None
    torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(short_negative, full_negative, rtol=1e-5, atol=1e-5)
    # Each prompt's rows do not depend on the others' lengths, and the padding is zeros as WanPipeline's.
    torch.testing.assert_close(alone[0], full[0], rtol=1e-5, atol=1e-5)
    words = len(tokenizer(PROMPTS[1]).input_ids)
    assert short[1, words:].abs().max() == 0 and short[1, words - 1].abs().max() > 0
