"""The causal student: a WanTransformer3DModel whose self-attention is block-causal over chunks of
latent frames, and what streams it.

- `attention`: the student kind itself: its layout (chunk size), the rotary embedding that places a
  chunk at its absolute frame index, the self-attention processor that lets chunk k see chunks <= k
  (and the KV cache of the chunks before), installed with diffusers' attention-processor interface on
  an unchanged model; `causal_config.json` beside an exported student records the chunk size.
- `experts`: a LoRA student's causal kind: the teacher's experts, causal while the student's adapters
  run (the teacher and the critic still attend over the whole clip), each with its own cache entries.
- `kv_cache`: the keys and values of the finished (clean) chunks, per layer, in a rolling window.
- `streaming`: the streaming sampler: each chunk denoised in the student's few steps on top of the
  cache, then one pass at t=0 that adds it to the cache; yields each clean chunk as it finishes.
- `decode`: the Wan VAE decoding chunk after chunk with its causal caches kept between chunks, so
  frames come out as each chunk finishes and equal those of one decode of the whole clip.

The weights layout is a WanTransformer3DModel's: `WanTransformer3DModel.from_pretrained` loads a
causal student (bidirectional); `load_causal` (or `make_causal` with its chunk size) turns it causal.
"""
