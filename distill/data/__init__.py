"""What training reads: prompt files (`prompts`), the prompt-embedding and clean-latent caches
(`caches`), filling them once with the text encoder and the teacher's sampler (`prepare`), and the
dataset and resumable order over them (`dataset`). Imports distill.models (the teacher fills the
caches), distill.config and distill.ops.
"""
