"""The image-latent cache: each conditioning image encoded once by the teacher's VAE, beside the
prompt-embedding cache.

Entries are named by a hash of the image file's bytes, not its path: the same picture under two
names (or moved) is encoded once, and an image edited in place gets a new entry. The folder's
`settings.json` records what the latents depend on (the VAE, height, width, frame count, dtype);
a cache made with others is refused naming the folder, never mixed (distill.data.caches.TensorCache
does both, and writes each entry under a temporary name renamed into place, so a crash or a
failing encode leaves no half-written entry).

The encoding itself is a callable from the caller (the teacher kind's conditioning), so this module
knows nothing of how an image enters a forward.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from distill.data.caches import TensorCache
from distill.data.images import ImagePrompt

# (1, 3, height, width) pixels in [-1, 1] -> the latent a forward is conditioned on.
ImageEncoder = Callable[[torch.Tensor], torch.Tensor]


def image_key(path: str | Path) -> str:
    """A content key for an image file: the hash of its bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:32]


class ImageLatentCache(TensorCache):
    """A TensorCache whose keys are image content keys (`image_key`), used as the file names."""

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"


def image_latent_cache(
    cache_dir: str | Path, vae: str, height: int, width: int, num_frames: int, dtype: torch.dtype
) -> ImageLatentCache:
    """The image-latent cache under `cache_dir`, refused (a data error naming the folder and what
    differs) when it was made with another VAE (`vae`: its fingerprint), size or frame count."""
    settings = {
        "vae": vae,
        "height": height,
        "width": width,
        "num_frames": num_frames,
        "dtype": str(dtype),
    }
    cache = ImageLatentCache(Path(cache_dir) / "image_latents", settings, "image-latent")
    cache.open()
    return cache


def fill_image_latent_cache(
    cache: ImageLatentCache,
    pairs: Sequence[ImagePrompt],
    preprocess: Callable[[ImagePrompt], torch.Tensor],
    encode: ImageEncoder,
    known: Mapping[Path, str] | None = None,
) -> dict[Path, str]:
    """Encode the images the cache lacks (each distinct content once); returns every pair's image
    path -> its key, for looking the latents up while training. `known` holds keys already
    computed (path -> key), so no image is read twice just to hash it.

    An entry is stored only once its encoding has returned, so an encode that raises (out of
    memory, a damaged image) leaves the entries made before it and nothing else.
    """
    known = known or {}
    keys = {pair.image: known.get(pair.image) or image_key(pair.image) for pair in pairs}
    todo: dict[str, ImagePrompt] = {}
    for pair in pairs:
        key = keys[pair.image]
        if key not in todo and not cache.path(key).is_file():
            todo[key] = pair
    for key, pair in todo.items():
        with torch.no_grad():
            latent = encode(preprocess(pair))
        cache.put(key, latent)
    return keys
