"""The ORIGINAL Wan 2.2 T2V A14B checkpoint layout: recognise it (`detect`), convert it to the diffusers
layout once (`convert`, with the configs of `configs` and the key maps of `keymaps`), write it (tiny
teacher) and export a student in it (`export`).

    # Convert a download of Wan-AI/Wan2.2-T2V-A14B once (later loads read DST directly):
    python download_wan.py --convert models/Wan2.2-T2V-A14B models/Wan2.2-T2V-A14B-Diffusers
    # Or point the trainer at the original folder: it converts once into a cache and reuses it
    # ($WAN_DISTILL_CONVERT_DIR, default ~/.cache/wan-distill/converted):
    python train_distillation.py --teacher_path models/Wan2.2-T2V-A14B ...
    # A tiny random teacher in the original layout (tests, demos):
    python download_wan.py --tiny outputs/tiny-wan-original --layout original

The original layout (what Wan's own code and ComfyUI read):

    configuration.json                     {"framework": "Pytorch", "task": "text-to-video"} (optional)
    models_t5_umt5-xxl-enc-bf16.pth        UMT5-XXL encoder state dict in Wan's key names
    google/umt5-xxl/                       its tokenizer files
    Wan2.1_VAE.pth                         the VAE state dict in Wan's key names
    high_noise_model/, low_noise_model/    config.json (WanModel) + sharded safetensors + index

Conversion writes the diffusers layout (model_index.json, text_encoder/, tokenizer/, vae/,
transformer/ = high_noise_model, transformer_2/ = low_noise_model, scheduler/), so everything
downstream runs exactly as with Wan-AI/Wan2.2-T2V-A14B-Diffusers. The DiT and VAE key maps are
diffusers' own converters; our inverses are checked against them on every call. The T5 encoder
has no converter anywhere, so it has its own nine-rule map here. Every converted component is
checked key by key and shape by shape against the diffusers/transformers model it must load into.
"""
