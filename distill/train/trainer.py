"""The distillation run: checks, caches, the teacher and the trained models, then the loop and export.
`Distiller.run()` validates what it can before loading anything heavy, fills the prompt-embedding and
clean-latent caches, loads and places the teacher, builds the student (and whatever else the method
trains, e.g. the dmd critic), and hands them to `distill.train.loop.TrainingLoop`."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from distill.config.cli import save_resolved_config
from distill.config.settings import TrainConfig
from distill.data.caches import TensorCache
from distill.data.dataset import DistillationDataset
from distill.data.prepare import (
    ImageInputs,
    embedding_cache,
    fill_condition_cache,
    fill_embedding_cache,
    fill_latent_cache,
    image_inputs,
    latent_cache,
    open_condition_cache,
)
from distill.data.prompts import reference_prompts
from distill.data.samples import read_training_samples
from distill.models.attention_backend import apply_backend, log_run_kernels
from distill.models.causal.attention import enable_checkpointing, make_causal
from distill.models.causal.experts import make_student_causal
from distill.models.conditioning import condition_entries
from distill.models.guided_teacher import GuidedTeacher
from distill.models.layout import require_weights
from distill.models.lora import CRITIC_ADAPTER, STUDENT_ADAPTER, ExpertCopies, LoraExperts, LoraShape
from distill.models.lora_folder import LoraFolder
from distill.models.original.configs import check_original_exportable
from distill.models.student import build_student, init_student_from_teacher, load_pretrained_student
from distill.models.student_config import load_student_config
from distill.models.teacher import (
    inspect_teacher,
    load_experts,
    place_expert,
    resolve_dtype,
)
from distill.ops import distributed as dist_utils
from distill.ops.distributed import DistContext
from distill.ops.errors import DistillError, Progress, Stage
from distill.ops.output_dir import hold_output_dir, require_replaceable, writable_folder
from distill.ops.paths import check_paths
from distill.report.monitor import SampleMonitor, SampleSettings
from distill.sample.lora_fit import lora_start
from distill.train import checkpoint as ckpt
from distill.train import run_checks
from distill.train.export import EXPORTS, export_run
from distill.train.identity import check_identity, run_identity
from distill.train.loop import RunResult, TrainingLoop
from distill.train.methods import method_class
from distill.train.plan import choose_placement
from distill.train.plan_parallel import run_plan
from distill.train.sequence_parallel import context_groups, split_model

logger = logging.getLogger(__name__)
CPU_PLAN = "not measured for a run on the CPU (--dry_run prints it)"


class Distiller:
    """Holds everything a run needs; `run()` goes from caches to exported student."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext | None = None) -> None:
        self.cfg = cfg
        # Every path flag before the teacher is read; the output folders are proven writable too,
        # except by a dry run, which writes nothing (and may plan for another machine's paths).
        check_paths(cfg.path_flags(), probe=not cfg.dry_run)
        ckpt.check_resume_flag(cfg.resume)  # before the teacher and the caches cost anything
        self.ctx = ctx if ctx is not None else dist_utils.setup("auto", cfg.device)
        self.device = self.ctx.device
        self.is_main = self.ctx.is_main
        self.info = inspect_teacher(  # an original layout converted beside the cache; --teacher_lora read
            cfg.teacher_path,
            cfg.boundary_ratio,
            convert_dir=cfg.resolved_cache_dir / "teacher",
            configs_only=cfg.dry_run,
            loras=cfg.teacher_lora,
        )
        if not cfg.dry_run:  # a dry run plans from the configs alone (download_wan.py --configs_only)
            require_weights(self.info.path, self.info.kind.download_command(self.info.path))
        # Refuse a student that cannot work with this teacher before loading anything heavy.
        self.student_config = (
            dict(self.info.expert_config)
            if cfg.student_lora_rank
            else load_student_config(cfg.student_config, self.info.expert_config)
        )
        self.lora: LoraExperts | None = None  # the shared experts' adapters, once loaded
        if cfg.student_lora_rank:
            run_checks.check_lora_ranks(cfg, self.info.expert_config)
        # A wrong start (other shape or teacher, damaged file) is refused now; its weights load later.
        self.lora_init: LoraFolder | None = None
        if cfg.student_lora_init:
            self.lora_init = lora_start(
                cfg.student_lora_init,
                LoraShape(cfg.student_lora_rank, cfg.lora_alpha, cfg.lora_targets),
                self.info,
            )
        if "original" in cfg.export_formats.split(","):  # refused now, not after training
            check_original_exportable(
                self.student_config,
                f"the student of {cfg.student_config} (--export_formats original)",
                Stage.CONFIG,
            )
        run_checks.check_resolution(cfg, self.info, self.student_config)
        run_checks.check_one_transformer_settings(cfg, self.info)
        run_checks.check_causal_start(cfg.student_init, cfg.student_chunk_frames)
        run_checks.check_causal_lora_method(cfg, self.info)
        # A prompt per sample, with its image for an image-to-video teacher (read as its kind needs;
        # a dry run decodes each in full: what it passes, the real run can read).
        data, kind = cfg.data_path, self.info.kind
        self.samples = read_training_samples(data, kind, cfg.max_prompts, decode=cfg.dry_run)
        run_checks.check_sample_frames(cfg, self.info, image=self.samples[0].image is not None)
        self.prompts = [sample.prompt for sample in self.samples]
        # The samples the teacher samples a clean latent for before step 1: every training sample,
        # unless the method's updates never read them (data-free dmd: a reference set for metrics).
        self.clean_latents = method_class(cfg.method).needs_clean_latents(cfg)
        self.latent_samples = (
            self.samples if self.clean_latents else reference_prompts(self.samples, cfg.reference_prompts)
        )
        self.teacher_dtype = resolve_dtype(cfg.teacher_dtype, self.device)
        self.shift = cfg.flow_shift if cfg.flow_shift is not None else self.info.flow_shift
        # Refuse a bad critic config (dmd) before anything heavy, too.
        self.model_specs = self.resolve_model_specs()
        self.ctx = context_groups(cfg, self.info, self.ctx, self.student_config, self.critic_config)
        self.placement, self.placement_reason = choose_placement(
            cfg, self.info, self.student_config, self.device, self.ctx.world_size, self.critic_config
        )
        self.early_models: dict[str, torch.nn.Module] = {}
        self._identity: dict[str, Any] | None = None
        # Reads the sample/eval prompt files now, so a bad path fails before anything heavy loads.
        settings = SampleSettings.from_config(cfg)
        settings.validate()
        self.monitor = SampleMonitor(
            settings,
            self.info,
            cfg.output_dir,
            self.device,
            rank=self.ctx.data_rank,  # a context group (--sequence_parallel) samples as one,
            world_size=self.ctx.data_world,
            barrier=dist_utils.barrier,
            writes=self.ctx.rank % self.ctx.sequence_parallel == 0,  # its first rank writing the files
        )

    def plan(self) -> str:
        """Memory per device, forwards and GPU-hours of this run (--dry_run prints it; runs off the CPU log it)."""
        cfg, chosen = self.cfg, (self.placement, self.placement_reason)
        return run_plan(
            cfg, self.info, self.student_config, self.critic_config, self.device, self.ctx, chosen
        )

    @property
    def critic_config(self) -> dict[str, Any] | None:
        return self.model_specs["critic"][0] if "critic" in self.model_specs else None

    # -- preparation -----------------------------------------------------------------------
    def _open_shared(self, make_cache: Any) -> TensorCache:
        """Rank 0 creates the cache folder and its settings first; the others then check them."""
        cache = make_cache() if self.is_main else None
        dist_utils.barrier()
        return cache if cache is not None else make_cache()

    def _require_complete(self, cache: TensorCache, keys: list[str]) -> None:
        missing = cache.missing(keys)
        if missing:
            raise DistillError(
                f"the {cache.what} cache {cache.folder} lacks {len(missing)} entr(y/ies) after every rank built its share",
                f"first missing prompt: {missing[0]!r}",
                causes=[
                    "another rank failed while building its share",
                    "ranks see different --cache_dir contents",
                ],
                fixes=["put --cache_dir on storage every rank shares", "rerun: finished entries are kept"],
                stage=Stage.DATA,
            )

    def prepare_caches(
        self, result: RunResult
    ) -> tuple[TensorCache, TensorCache, torch.Tensor, GuidedTeacher, TensorCache | None]:
        cfg, rank, world = self.cfg, self.ctx.rank, self.ctx.world_size
        Progress.enter(Stage.DATA)
        everything = list(dict.fromkeys([*self.prompts, cfg.negative_prompt, *self.monitor.prompts]))
        embeddings = self._open_shared(lambda: embedding_cache(cfg, self.info, self.teacher_dtype))
        result.embeddings_built = fill_embedding_cache(
            embeddings,
            everything[rank::world],
            self.info,
            cfg.max_sequence_length,
            self.device,
            self.teacher_dtype,
            show_progress=self.is_main,
        )
        dist_utils.barrier()
        self._require_complete(embeddings, everything)
        negative = embeddings.get(cfg.negative_prompt)
        conditions, images = self.prepare_conditions(result)

        Progress.enter(Stage.TEACHER_LOAD)
        high, low = self.load_teacher_experts()
        Progress.enter(Stage.DATA)
        if not self.clean_latents and self.is_main:
            logger.info(
                "dmd with simulate inputs and no regression term never reads the teacher's clean latents: "
                "sampling them for %d reference prompt(s) only (--reference_prompts: latent drift and "
                "motion metrics), not for all %d training prompts",
                len(self.latent_samples),
                len(self.prompts),
            )
        latents = self._open_shared(lambda: latent_cache(cfg, self.info, self.teacher_dtype, embeddings))
        if self.lora is not None:
            self.lora.teacher_mode()  # the cached latents are the teacher's own samples
        result.latents_built = fill_latent_cache(
            latents,
            self.latent_samples[rank::world],
            embeddings,
            negative,
            cfg,
            self.info,
            high,
            low,
            self.device,
            self.is_main,
            lockstep_placeholder=self.samples[0] if self.placement == "shard" else None,
            images=images,
        )
        del images  # the VAE: only the caches needed it
        dist_utils.barrier()
        self._require_complete(latents, [sample.key for sample in self.latent_samples])
        if self.lora is not None:  # the teacher is the same experts with their adapters off
            high, low = self.lora.teacher_views()
        teacher = GuidedTeacher(
            split_model(self.ctx, high),
            split_model(self.ctx, low),
            self.info.boundary_ratio,
            cfg.guidance_scale,
            cfg.guidance_scale_2,
            self.device,
            self.teacher_dtype,
            lockstep=self.placement == "shard",
            kind=self.info.kind,
        )
        return embeddings, latents, negative, teacher, conditions

    def prepare_conditions(self, result: RunResult) -> tuple[TensorCache | None, ImageInputs | None]:
        """An image-to-video run: every sample's image encoded once into the image-latent cache (each rank
        its share); returns the cache and the VAE and preprocessing the teacher's clean-latent sampling
        needs too. (None, None) for a text-to-video teacher."""
        if not any(sample.image is not None for sample in self.samples):  # text to video
            return None, None
        rank, world = self.ctx.rank, self.ctx.world_size
        conditions = self._open_shared(lambda: open_condition_cache(self.cfg, self.info))
        images = image_inputs(self.cfg, self.info, self.device)
        result.conditions_built = fill_condition_cache(
            conditions, self.samples[rank::world], self.cfg, images, self.is_main, self.info.kind
        )
        dist_utils.barrier()
        self._require_complete(conditions, sorted({s.image_key for s in self.samples if s.image_key}))
        return conditions, images

    def load_teacher_experts(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        cfg, device = self.cfg, self.device
        waves = run_checks.teacher_load_waves(self.cfg, self.info, self.teacher_dtype)
        local_rank = self.ctx.local_rank
        per_wave = math.ceil(int(os.environ.get("LOCAL_WORLD_SIZE", "1")) / waves)
        experts: tuple[torch.nn.Module, torch.nn.Module | None] | None = None
        for wave in range(waves):  # every rank passes every barrier, loading in its own wave
            if local_rank // per_wave == wave:
                if waves > 1:
                    logger.warning("loading the teacher experts (wave %d of %d)", wave + 1, waves)
                high, low = load_experts(self.info, self.teacher_dtype)
                if cfg.student_lora_rank:  # before placement: the adapters move with the experts
                    self.lora = self.add_lora(high, low)
                for name, (config, init) in self.model_specs.items():
                    if init == "teacher":  # before placement: a sharded expert has no whole tensors
                        self.early_models[name] = self.init_from_teacher(
                            config, high if cfg.student_init_expert == "high" or low is None else low, name
                        )
                shard_over = self.ctx.world_size if self.placement == "shard" else 0
                on_cpu = self.placement == "cpu"
                experts = (
                    place_expert(high, device, on_cpu, shard_over),
                    None if low is None else place_expert(low, device, on_cpu, shard_over),
                )
                apply_backend(cfg.attention_backend, *experts)  # the LoRA student's and critic's adapters too
            if waves > 1:
                dist_utils.barrier()
        assert experts is not None
        return experts

    def add_lora(self, high: torch.nn.Module, low: torch.nn.Module | None) -> LoraExperts:
        """The adapters of a LoRA run on the loaded experts, both or the one transformer of a teacher
        without a boundary (`low` None); a full dmd critic: copies made first."""
        cfg = self.cfg
        if "critic" in self.model_specs and self.model_specs["critic"][1] == "copy":
            self.early_models["critic"] = ExpertCopies(
                copy.deepcopy(high).float(),
                None if low is None else copy.deepcopy(low).float(),
                self.info.boundary_ratio,
            )
        critic = cfg.critic_adapter_rank if "critic" in self.model_specs else 0
        shape = LoraShape(cfg.student_lora_rank, cfg.lora_alpha, cfg.lora_targets)
        lora = LoraExperts(
            high, low, shape, LoraShape(critic, float(critic), cfg.lora_targets) if critic else None, cfg.seed
        )
        if self.lora_init is not None:
            lora.load(STUDENT_ADAPTER, self.lora_init.states())
        if (
            cfg.student_chunk_frames
        ):  # causal while the student's adapters run (a full critic's copies: whole)
            make_student_causal(lora, cfg.student_chunk_frames)
        return lora

    def init_from_teacher(
        self, config: dict[str, Any], expert: torch.nn.Module, name: str = "student"
    ) -> torch.nn.Module:
        model = build_student(config, seed=self.cfg.seed)
        report = init_student_from_teacher(model, expert)
        logger.info("%s initialised from the %s-noise expert: %s", name, self.cfg.student_init_expert, report)
        return model

    def resolve_model_specs(self) -> dict[str, tuple[dict[str, Any], str]]:
        """(config, init) of every trained model: the student, and what the method adds (dmd: a critic,
        by default the student's shape, initialised like the student)."""
        cfg = self.cfg
        if cfg.student_lora_rank:
            specs = {"student": (self.student_config, "lora")}
            if cfg.trains_critic:
                specs["critic"] = (self.student_config, "lora" if cfg.critic_adapter_rank else "copy")
            return specs
        specs = {"student": (self.student_config, cfg.student_init)}
        for name, (config_path, init) in method_class(cfg.method).extra_models(cfg).items():
            config = (
                load_student_config(config_path, self.info.expert_config)
                if config_path
                else self.student_config
            )
            specs[name] = (config, init or cfg.student_init)
        return specs

    def make_model(self, name: str = "student") -> torch.nn.Module:
        cfg = self.cfg
        config, init = self.model_specs[name]
        if init == "lora":
            assert self.lora is not None
            adapter = STUDENT_ADAPTER if name == "student" else CRITIC_ADAPTER
            model = self.lora.model(adapter, self.info.boundary_ratio, cfg.phase_experts)
            model.lockstep = self.placement == "shard"  # the experts' forwards are collectives
        elif init in ("teacher", "copy"):
            model = self.early_models.pop(name)
        elif init == "random":
            model = build_student(config, seed=cfg.seed)
        else:
            # The option that named this start: a critic without its own --critic_init takes the student's.
            own = name != "student" and getattr(cfg, f"{name}_init", None)
            flag = f"--{name}_init" if own else "--student_init"
            model = load_pretrained_student(init, self.info.expert_config, flag=flag)
            run_checks.check_pretrained_shape(model.config, config, init, flag, name)
        if name == "student" and cfg.student_chunk_frames and init != "lora":
            # The student kind: causal over chunks (the critic stays bidirectional; LoRA: in add_lora).
            make_causal(model, cfg.student_chunk_frames)
        if cfg.gradient_checkpointing:
            # A causal student's recompute in backward must see its pass as the forward did.
            enable_checkpointing(model)
        apply_backend(cfg.attention_backend, model)  # before the split, which keeps it
        return split_model(self.ctx, model.to(self.device).train())

    @property
    def latent_frames(self) -> int:
        return self.info.latent_shape(self.cfg.height, self.cfg.width, self.cfg.num_frames)[1]

    def teacher_noise_for_regression(self) -> Any:
        """prompt -> the initial noise the teacher sampled its cached clean latent from (dmd regression,
        ode_init: the noise -> x0 pairs)."""
        if not method_class(self.cfg.method).needs_teacher_noise(self.cfg):
            return None
        from distill.data.prepare import prompt_seed
        from distill.models.pipelines import initial_noise

        shape = self.info.latent_shape(self.cfg.height, self.cfg.width, self.cfg.num_frames)
        return lambda prompt: initial_noise(shape, prompt_seed(self.cfg.seed, prompt))[0]

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this run (computed once: every save
        stores it, and the teacher fingerprint reads the weight files)."""
        if self._identity is None:
            keys = [sample.key for sample in self.samples]
            self._identity = run_identity(self.cfg, self.info, self.student_config, keys, self.shift)
        return self._identity

    def check_checkpoint(self, path: Path, meta: dict[str, Any]) -> None:
        """Refuse to resume a checkpoint made for another student, teacher or prompt set (unless forced)."""
        check_identity(path, meta, self.identity(), self.cfg.force_resume, self.samples, self.cfg.num_steps)

    def check_output_dir(self) -> None:
        """Before any heavy work: never overwrite another run's checkpoints, never resume a foreign one
        or one past this run's end, and be able to replace the exports and checkpoints in the folder."""
        require_replaceable(self.cfg.output_dir, (*EXPORTS, "checkpoints"))
        complete = ckpt.complete_checkpoints(ckpt.checkpoint_root(self.cfg.output_dir))
        if self.cfg.resume == "none":
            if complete:
                raise DistillError(
                    f"--output_dir {self.cfg.output_dir} already holds checkpoints (newest: {complete[-1].name})",
                    "--resume none would start over and then overwrite and prune them.",
                    fixes=[
                        "continue that run: --resume auto",
                        "or start this one in another --output_dir",
                        f"or delete {ckpt.checkpoint_root(self.cfg.output_dir)} if it is no longer needed",
                    ],
                    stage=Stage.CHECKPOINT,
                )
            return
        candidate = (
            Path(self.cfg.resume) if self.cfg.resume != "auto" else (complete[-1] if complete else None)
        )
        if candidate is not None and (candidate / "meta.json").is_file():
            meta = json.loads((candidate / "meta.json").read_text())
            self.check_checkpoint(candidate, meta)
            if self.cfg.num_steps is not None:  # --num_epochs: checked once the steps are counted
                ckpt.refuse_past_end(candidate, int(meta["step"]), self.cfg.num_steps, by_epochs=False)

    # -- training --------------------------------------------------------------------------
    def run(self) -> RunResult:
        out = writable_folder(self.cfg.output_dir, "--output_dir")
        # Rank 0 holds the folder (the other ranks belong to the same run); released however run() ends.
        with hold_output_dir(out) if self.is_main else contextlib.nullcontext():
            return self._run(out)

    def _run(self, out: Path) -> RunResult:
        cfg = self.cfg
        self.check_output_dir()
        if self.is_main:  # the plan measures on fake tensors, seconds apiece: on the CPU, --dry_run only
            unmeasured = f"teacher placement: {self.placement} ({self.placement_reason})\n{CPU_PLAN}"
            logger.info("plan:\n%s", unmeasured if self.device.type == "cpu" else self.plan())
        result = RunResult(output_dir=out)
        embeddings, latents, negative, teacher, conditions = self.prepare_caches(result)
        dataset = DistillationDataset(
            self.samples,
            latents,
            embeddings,
            cfg.max_sequence_length,
            self.teacher_noise_for_regression(),
            clean_latents=self.clean_latents,
            reference=self.latent_samples,
            conditions=conditions,
            condition_entries=functools.partial(
                condition_entries, self.info.kind, latent_frames=self.latent_frames
            ),
        )
        student = self.make_model("student")
        extra = {name: self.make_model(name) for name in self.model_specs if name != "student"}
        loop = TrainingLoop(cfg, self, student, teacher, dataset, negative, out, extra)
        result.resumed_from = loop.maybe_resume()
        if self.is_main:  # only once the run is known to go ahead: a refused resume keeps the old one
            save_resolved_config(cfg, out / "run_config.json")
            log_run_kernels(cfg, self.info, self.student_config, self.teacher_dtype, self.device)
        loop.train(result)
        # No update of any model made (not merely none of the student: a resumed dmd run's last steps
        # may all be critic updates, whose rows log critic_loss only).
        learned = any(
            value is not None
            for row in result.history
            for key, value in row.items()
            if key == "loss" or key.endswith("_loss")
        )
        if result.history and not learned and result.stopped_by_signal is None:
            raise DistillError(
                f"every step of this run was skipped: {result.bad_steps} step(s) with a non-finite loss or gradient",
                "Nothing was learned, so nothing is exported; the checkpoints written before are kept.",
                causes=[
                    "learning rate too high",
                    "fp16 overflow",
                    "non-finite teacher outputs or cached latents",
                ],
                fixes=[
                    "lower --lr (or use --mixed_precision bf16), then rerun with --resume auto",
                    "--max_bad_steps N stops such a run after N skipped steps in a row",
                ],
                stage=Stage.TRAINING,
            )
        if result.stopped_by_signal is None:
            result.student_dir, result.ema_dir = export_run(loop)
        # No rank leaves before rank 0 has finished writing: under torchrun the first rank to exit
        # with a non-zero code (75 after a preemption) makes the agent stop the others.
        dist_utils.barrier()
        return result
