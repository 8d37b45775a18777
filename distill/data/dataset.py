"""What training reads: one (clean latent, prompt embedding) pair per sample from the two caches,
zero-padded to the run's text length, and for image to video the sample's condition (the image's
latent, from the image-latent cache), in an order that a resumed run continues exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from distill.data.caches import TensorCache
from distill.data.samples import TrainingSample
from distill.models.flow_matching import frame_change


class DistillationDataset(torch.utils.data.Dataset):
    """Zero-padded prompt embedding and clean latent x0 of each training prompt, read from the caches.

    A run whose updates never read x0 (dmd with simulate inputs and no regression) sets
    `clean_latents=False`: its items carry no x0, and only the `reference` prompts have a cached clean
    latent, for the metrics that compare the student's samples with the teacher's.
    """

    def __init__(
        self,
        samples: Sequence[TrainingSample | str],
        latents: TensorCache,
        embeddings: TensorCache,
        max_length: int,
        noise_for: Callable[[str], torch.Tensor] | None = None,
        clean_latents: bool = True,
        reference: Sequence[TrainingSample | str] | None = None,
        conditions: TensorCache | None = None,
        condition_entries: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.samples = [as_sample(sample) for sample in samples]
        self.latents, self.embeddings = latents, embeddings
        self.max_length = max_length
        # With it, items also carry the initial noise the teacher sampled x0 from (its noise -> x0 pair).
        self.noise_for = noise_for
        self.clean_latents = clean_latents
        # The samples with a cached clean latent: every training sample, or the reference set.
        self.reference = (
            self.samples if clean_latents or reference is None else [as_sample(s) for s in reference]
        )
        # The image-latent cache (image to video): each item's condition, by its image's content key.
        self.conditions = conditions
        # What an item carries of its cached condition (conditioning.condition_entries of the kind).
        self.condition_entries = condition_entries or (lambda stored: {"condition": stored})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        item = {
            "cond": pad_embedding(self.embeddings.get(sample.prompt), self.max_length),
            "index": torch.tensor(index),
        }
        if self.clean_latents:
            item["x0"] = self.latents.get(sample.key)
        if self.noise_for is not None:
            item["noise"] = self.noise_for(sample.key)
        if self.conditions is not None and sample.image_key is not None:
            item.update(self.condition_entries(self.conditions.get(sample.image_key)))
        return item

    def latent_shape(self) -> tuple[int, ...]:
        """(C, F, H, W) of one clean latent, as the teacher sampled it."""
        return tuple(self.latents.get(self.reference[0].key).shape)

    def clean_latent_statistics(self, limit: int = 256) -> tuple[float, float]:
        """Mean and std over every element of the first `limit` cached clean latents (the teacher's)."""
        total = squares = count = 0.0
        for sample in self.reference[:limit]:
            x0 = self.latents.get(sample.key).double()
            total, squares, count = (
                total + x0.sum().item(),
                squares + x0.pow(2).sum().item(),
                count + x0.numel(),
            )
        mean = total / count
        return mean, max(squares / count - mean * mean, 0.0) ** 0.5

    def reference_motion(self, limit: int = 256) -> float | None:
        """The teacher's mean frame-to-frame change over the first `limit` cached clean latents
        (`flow_matching.frame_change`); None for pictures."""
        changes = [frame_change(self.latents.get(sample.key)[None]) for sample in self.reference[:limit]]
        if changes[0] is None:
            return None
        return float(torch.cat(changes).double().mean())


def as_sample(sample: TrainingSample | str) -> TrainingSample:
    """A prompt alone is a text-to-video sample."""
    return sample if isinstance(sample, TrainingSample) else TrainingSample(sample)


def pad_embedding(embedding: torch.Tensor, max_length: int) -> torch.Tensor:
    """Zero-pad a (tokens, dim) embedding to max_length rows, exactly as WanPipeline pads prompts."""
    padded = embedding.new_zeros(max_length, embedding.shape[-1])
    padded[: embedding.shape[0]] = embedding[:max_length]
    return padded


class ResumableSampler(torch.utils.data.Sampler[int]):
    """This rank's share of one global stream of shuffled epochs, resumable from a sample count.

    The global stream concatenates permutations drawn from `seed + epoch`. It is cut into global
    batches of `batch_size * world_size`; rank r reads slice r of each. So the samples a step sees
    do not depend on how many processes share the global batch, and resuming needs only the
    number of global samples consumed (a DataLoader reads ahead, so the sampler's own position is
    not what training has used).
    """

    def __init__(
        self, num_items: int, seed: int, batch_size: int = 1, rank: int = 0, world_size: int = 1
    ) -> None:
        self.num_items, self.seed = num_items, seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.start = 0

    def start_at(self, consumed: int) -> None:
        """Continue after `consumed` global samples."""
        self.start = consumed

    def _global_stream(self, start: int) -> Iterator[int]:
        epoch, position = divmod(start, self.num_items)
        while True:
            order = torch.randperm(
                self.num_items, generator=torch.Generator().manual_seed(self.seed + epoch)
            ).tolist()
            yield from order[position:]
            epoch, position = epoch + 1, 0

    def __iter__(self) -> Iterator[int]:
        global_batch = self.batch_size * self.world_size
        for offset, index in enumerate(self._global_stream(self.start)):
            if ((self.start + offset) % global_batch) // self.batch_size == self.rank:
                yield index

    def __len__(self) -> int:
        return max(1, self.num_items // self.world_size)
