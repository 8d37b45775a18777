"""Before training: fill the prompt-embedding cache (text encoder) and the clean-latent cache (teacher sampler).

Each stage loads only the models it needs and frees them when done; a second run with the same
teacher and settings finds both caches full and loads neither the text encoder nor runs a sampler.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from distill.config.settings import TrainConfig
from distill.data.caches import TensorCache, fill_cache, prompt_key
from distill.data.image_latents import ImageLatentCache, image_latent_cache
from distill.data.images import ImagePrompt
from distill.data.samples import TrainingSample
from distill.models.flow_matching import NUM_TRAIN_TIMESTEPS
from distill.models.teacher import TeacherInfo, empty_device_cache, load_text_encoder
from distill.models.teacher_kind import I2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)


@dataclass
class CacheReport:
    embeddings_built: int
    latents_built: int


def embedding_cache(cfg: TrainConfig, info: TeacherInfo, dtype: torch.dtype) -> TensorCache:
    settings = {
        "text_encoder": info.fingerprint("text_encoder", "tokenizer"),
        "max_sequence_length": cfg.max_sequence_length,
        "dtype": str(dtype),
    }
    return TensorCache(cfg.resolved_cache_dir / "embeddings", settings, "prompt-embedding").open()


def latent_cache(
    cfg: TrainConfig, info: TeacherInfo, dtype: torch.dtype, embeddings: TensorCache
) -> TensorCache:
    settings = {
        "teacher": info.fingerprint(*info.expert_folders, "scheduler"),
        "embeddings": embeddings.settings["text_encoder"],
        "height": cfg.height,
        "width": cfg.width,
        "num_frames": cfg.num_frames,
        "teacher_sample_steps": cfg.teacher_sample_steps,
        "guidance_scale": cfg.guidance_scale,
        "guidance_scale_2": cfg.guidance_scale_2,
        "boundary_ratio": info.boundary_ratio,
        "negative_prompt": cfg.negative_prompt,
        "seed": cfg.seed,
        "dtype": str(dtype),
    }
    # One folder per set of sampling settings, side by side: stage 1 (guidance 1) and stage 2 (the
    # teacher's guidance) share a --cache_dir, its prompt embeddings, and each keeps its own latents.
    root = cfg.resolved_cache_dir / "latents"
    if (root / "settings.json").is_file():
        logger.warning(
            "%s holds clean latents in an earlier layout (one folder for every setting); they are not "
            "used: delete its *.safetensors and settings.json once no older version needs them",
            root,
        )
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return TensorCache(root / key, settings, "clean-latent").open()


def fill_embedding_cache(
    cache: TensorCache,
    prompts: Sequence[str],
    info: TeacherInfo,
    max_length: int,
    device: torch.device,
    dtype: torch.dtype,
    show_progress: bool = True,
) -> int:
    """Encode the prompts the cache lacks; store each embedding trimmed to its real token count."""
    todo = cache.missing(prompts)
    if not todo:
        return 0
    logger.info("encoding %d prompt(s) with the teacher's text encoder", len(todo))
    pipe = load_text_encoder(info, device, dtype)
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    from distill.models.pipelines import encode_on_needed_tokens

    truncated = 0

    def encode(chunk: list[str]) -> list[torch.Tensor]:
        nonlocal truncated
        ids = pipe.tokenizer([prompt_clean(p) for p in chunk], add_special_tokens=True)["input_ids"]
        lengths = [min(len(i), max_length) for i in ids]
        truncated += sum(len(i) > max_length for i in ids)
        with torch.no_grad():  # on the tokens the chunk needs: the padding was 512 - n rows of work
            embeds = encode_on_needed_tokens(pipe, chunk, max_length, device, dtype=dtype)[0]
        return [e[:n].cpu() for e, n in zip(embeds, lengths)]

    with tqdm(total=len(todo), desc="text embeddings", disable=not show_progress) as bar:
        built = fill_cache(cache, todo, encode, batch_size=8, progress=bar.update)
    if truncated:
        logger.warning(
            "%d prompt(s) are longer than %d tokens and were truncated (the text encoder's limit)",
            truncated,
            max_length,
        )
    pipe = None  # its last reference (shared with `encode`): the text encoder is freed here
    empty_device_cache()
    return built


def prompt_seed(seed: int, prompt: str) -> int:
    """A per-prompt sampling seed: independent of prompt order and of which rank samples it."""
    return (seed * 1_000_003 + int(prompt_key(prompt)[:12], 16)) % (2**63)


def non_finite_teacher_error(
    info: TeacherInfo, cfg: TrainConfig, prompt: str, timestep: float
) -> DistillError:
    """The teacher sampled NaN or inf: name the expert that owns the first bad step."""
    high = info.boundary_ratio is None or timestep >= info.boundary_ratio * NUM_TRAIN_TIMESTEPS
    folder = "transformer" if high else "transformer_2"
    which = "transformer" if info.boundary_ratio is None else f"{'high' if high else 'low'}-noise expert"
    return DistillError(
        f"the teacher's {which} ({folder}/) produced non-finite values "
        f"at t = {timestep:.0f} while sampling the clean-latent cache",
        f"prompt: {prompt!r}\nNothing non-finite was cached: training on it would teach the student NaN.",
        causes=[
            f"damaged weights in {info.path / folder} (a truncated or overwritten download)",
            f"--teacher_dtype float16 overflowing (this run: {cfg.teacher_dtype})",
        ],
        fixes=[
            f"replace {info.path / folder} with a fresh copy of the teacher's files (python download_wan.py)",
            "--teacher_dtype bfloat16 (or float32) if the teacher runs in float16",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def fill_latent_cache(
    cache: TensorCache,
    samples: Sequence[TrainingSample | str],
    embeddings: TensorCache,
    negative: torch.Tensor,
    cfg: TrainConfig,
    info: TeacherInfo,
    high: torch.nn.Module,
    low: torch.nn.Module | None,
    device: torch.device,
    show_progress: bool = True,
    lockstep_placeholder: TrainingSample | str | None = None,
    images: ImageInputs | None = None,
) -> int:
    """Sample a clean latent x0 for each sample the cache lacks, with the teacher's own sampler.

    Runs the stock pipeline of the teacher's kind (WanPipeline; WanImageToVideoPipeline, given each
    sample's image) with both experts, their guidance scales and the teacher's scheduler, and keeps
    the final latent (before the VAE), one sample at a time with a seed derived from the sample's
    key, so the cache does not depend on batch composition or rank.

    With a sharded teacher every rank must run the same number of sampler calls (each forward
    gathers weights from all ranks): pass `lockstep_placeholder`, a sample that ranks with fewer
    missing entries sample (and discard) until every rank has done as many calls as the busiest.
    """
    from distill.data.dataset import as_sample

    wanted = {sample.key: sample for sample in map(as_sample, samples)}
    todo: list[TrainingSample | None] = [wanted[key] for key in cache.missing(list(wanted))]
    if lockstep_placeholder is not None:
        from distill.ops.distributed import all_reduce_max

        calls = all_reduce_max(len(todo))
        todo += [None] * (calls - len(todo))
    if not todo:
        return 0
    from distill.data.dataset import pad_embedding
    from distill.models.pipelines import load_scheduler, preprocessed_images, teacher_pipeline

    vae = images.vae if images is not None else None
    pipe = teacher_pipeline(
        high,
        low,
        info.boundary_ratio,
        load_scheduler(info.path),
        info.kind,
        image=images is not None,
        vae=vae,
        vae_scales=(info.vae_scale_spatial, info.vae_scale_temporal),
    )
    dtype = high.dtype  # the model's compute dtype (diffusers keeps some parameters in float32)
    negative_embeds = pad_embedding(negative, cfg.max_sequence_length)[None].to(device, dtype)
    logger.info(
        "sampling %d clean latent(s) with the teacher (%d steps, %dx%d, %d frame(s))",
        len(todo),
        cfg.teacher_sample_steps,
        cfg.height,
        cfg.width,
        cfg.num_frames,
    )

    def sample(item: TrainingSample) -> torch.Tensor:
        cond = pad_embedding(embeddings.get(item.prompt), cfg.max_sequence_length)[None].to(device, dtype)
        first_non_finite: list[float] = []

        def watch(_pipe: Any, _step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            # One check per sampler step (a device sync, only while the cache is filled): the first
            # non-finite step says which expert produced it.
            if not first_non_finite and not torch.isfinite(tensors["latents"]).all():
                first_non_finite.append(float(timestep))
            return tensors

        extra: dict[str, Any] = {}
        if item.image is not None:
            if images is None:
                raise ValueError(f"{info.kind.model} samples need their images: pass images=")
            extra["image"] = images.preprocess(item.image)
        with torch.no_grad(), preprocessed_images(pipe, item.image is not None):
            latents = pipe(
                prompt_embeds=cond,
                negative_prompt_embeds=negative_embeds,
                height=cfg.height,
                width=cfg.width,
                num_frames=cfg.num_frames,
                num_inference_steps=cfg.teacher_sample_steps,
                guidance_scale=cfg.guidance_scale,
                # The stock pipelines refuse a second scale where there is no second expert.
                guidance_scale_2=cfg.guidance_scale_2 if low is not None else None,
                generator=torch.Generator("cpu").manual_seed(prompt_seed(cfg.seed, item.key)),
                output_type="latent",
                max_sequence_length=cfg.max_sequence_length,
                callback_on_step_end=watch,
                callback_on_step_end_tensor_inputs=["latents"],
                **extra,
            ).frames
        if first_non_finite:
            raise non_finite_teacher_error(info, cfg, item.prompt, first_non_finite[0])
        return latents[0].float().cpu()

    built = 0
    with tqdm(total=len(todo), desc="teacher latents", disable=not show_progress) as bar:
        for item in todo:
            if item is None:  # a lockstep call: keeps the sharded experts' collectives in step
                assert lockstep_placeholder is not None
                sample(as_sample(lockstep_placeholder))
            else:
                cache.put(item.key, sample(item))
                built += 1
            bar.update(1)
    return built


class ImageInputs:
    """What sampling image-to-video latents needs besides the experts: the teacher's VAE (the stock
    pipeline encodes each image itself) and the run's image preprocessing. The VAE is loaded on
    first use: a run whose caches are full (a resume) never loads it."""

    def __init__(
        self, load_vae: Callable[[], Any], preprocess: Callable[[ImagePrompt], torch.Tensor]
    ) -> None:
        self._load_vae, self._vae = load_vae, None
        self.preprocess = preprocess

    @property
    def vae(self) -> Any:
        if self._vae is None:
            self._vae = self._load_vae()
        return self._vae


def open_condition_cache(cfg: TrainConfig, info: TeacherInfo) -> ImageLatentCache:
    """The image-latent cache of this run's teacher VAE, size and frame count (refused if made with
    others: distill.data.image_latents.image_latent_cache)."""
    return image_latent_cache(
        cfg.resolved_cache_dir,
        info.fingerprint("vae"),
        cfg.height,
        cfg.width,
        cfg.num_frames,
        torch.float32,
    )


def image_inputs(cfg: TrainConfig, info: TeacherInfo, device: torch.device) -> ImageInputs:
    """The teacher's VAE (float32, as the stock pipeline is run) and the run's image preprocessing."""
    from distill.data.images import ImagePreprocessor
    from distill.models.pipelines import load_vae

    return ImageInputs(
        lambda: load_vae(info.path, device),
        ImagePreprocessor(cfg.height, cfg.width, info.vae_scale_spatial),
    )


def fill_condition_cache(
    cache: ImageLatentCache,
    samples: Sequence[TrainingSample],
    cfg: TrainConfig,
    inputs: ImageInputs,
    show_progress: bool = True,
    kind: TeacherKind = I2V_A14B,
) -> int:
    """Encode the images of `samples` the cache lacks into their conditions for a teacher of `kind`
    (distill.models.conditioning.image_condition: I2V-A14B's mask and image latent, TI2V-5B's image
    latent frame), each distinct image once. Returns how many."""
    from distill.data.image_latents import fill_image_latent_cache
    from distill.models.conditioning import image_condition, stored_condition

    pairs = [sample.image for sample in samples if sample.image is not None]
    missing = {
        sample.image_key
        for sample in samples
        if sample.image_key and not cache.path(sample.image_key).is_file()
    }
    if not missing:
        return 0
    logger.info("encoding %d conditioning image(s) with the teacher's VAE", len(missing))
    with tqdm(total=len(missing), desc="image latents", disable=not show_progress) as bar:

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            bar.update(1)
            return stored_condition(image_condition(inputs.vae, pixels, cfg.num_frames, kind=kind)).cpu()

        known = {s.image.image: s.image_key for s in samples if s.image is not None and s.image_key}
        fill_image_latent_cache(cache, pairs, inputs.preprocess, encode, known)
    return len(missing)
