"""The ORIGINAL Wan 2.2 checkpoint layouts (T2V-A14B, I2V-A14B, TI2V-5B): recognise them (`detect`),
convert them to the diffusers layout once (`convert`, with the configs of `configs` and the key maps
of `keymaps`), write them (tiny teachers) and export a student in them (`export`).

    # Convert a download of Wan-AI/Wan2.2-T2V-A14B once (later loads read DST directly):
    python download_wan.py --convert models/Wan2.2-T2V-A14B models/Wan2.2-T2V-A14B-Diffusers
    # Or point the trainer at the original folder: it converts once into a cache and reuses it
    # ($WAN_DISTILL_CONVERT_DIR, default ~/.cache/wan-distill/converted):
    python train_distillation.py --teacher_path models/Wan2.2-T2V-A14B ...
    # A tiny random teacher in the original layout (tests, demos), also of TI2V-5B:
    python download_wan.py --tiny outputs/tiny-wan-original --layout original
    python download_wan.py --tiny outputs/tiny-ti2v-original --layout original --tiny_kind ti2v

The original layout (what Wan's own code and ComfyUI read):

    configuration.json                     {"framework": "Pytorch", "task": "text-to-video"} (optional)
    models_t5_umt5-xxl-enc-bf16.pth        UMT5-XXL encoder state dict in Wan's key names
    google/umt5-xxl/                       its tokenizer files
    Wan2.1_VAE.pth                         the VAE state dict in Wan's key names
    high_noise_model/, low_noise_model/    config.json (WanModel) + sharded safetensors + index

Wan-AI/Wan2.2-TI2V-5B keeps the same T5 files, Wan2.2_VAE.pth (the 48-channel Wan2.2 VAE) and its
one WanModel at the top of the folder: config.json (model_type ti2v), diffusion_pytorch_model-0000N-
of-00003.safetensors and their index. It converts to WanPipeline with expand_timesteps true and one
transformer/ (no transformer_2/, boundary_ratio null), as Wan-AI/Wan2.2-TI2V-5B-Diffusers.

Conversion writes the diffusers layout (model_index.json, text_encoder/, tokenizer/, vae/,
transformer/ = high_noise_model, transformer_2/ = low_noise_model, scheduler/), so everything
downstream runs exactly as with Wan-AI/Wan2.2-T2V-A14B-Diffusers. The DiT and Wan2.1 VAE key
maps are diffusers' own converters; our inverses are checked against them on every call. The Wan2.2
VAE has no converter in diffusers' library: both directions are ours (checked against Wan's own
wan/modules/vae2_2.py by tests/test_ti2v_original_layout.py where that code is importable). The T5 encoder
has no converter anywhere, so it has its own nine-rule map here. Every converted component is
checked key by key and shape by shape against the diffusers/transformers model it must load into.
"""
