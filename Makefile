# `make demo` and `make test` set everything up on a fresh machine: they create .venv when it is
# missing and (re)install requirements.txt whenever it changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-requirements

# The demos own their outputs/ teacher folders: --overwrite replaces one an older checkout wrote
# (download_wan.py keeps a folder holding other files without it).
DEMO_TEACHER := outputs/toy-wan
DEMO_OUT := outputs/demo
# When this make started: `make test` prints the time since, set-up included.
MAKE_START := $(shell date +%s)
# `make demo SEED=1` trains with another seed (noise, timesteps, data order); the evaluation's noise
# stays the same, so runs compare on the same samples.
SEED ?= 0
# The toy models are tiny: one thread per process beat two on 2 cores, by far when anything else
# runs (the teacher-latent cache took 21 s against 3 min beside another job).
DEMO_ENV := OMP_NUM_THREADS=1

.PHONY: demo demo-clips demo-i2v demo-user-lora demo-stream test proofs gpu-check lint format clean toy-stage1 toy-stage1-clips toy-causal

# Bytecode is written as modules are first imported, not for the whole venv up front: compiling all
# of it (compileall on both cores) took 33 s of a fresh clone's set-up, while what the suite and the
# demos import is about a quarter of it (~6 CPU s). A shell may set PYTHONDONTWRITEBYTECODE=1; then
# no process would write any and every one would compile torch again, so make does not pass it on.
# The modules nearly every test process imports are imported once here, so that the suite's
# parallel workers start from their bytecode instead of all compiling the same files at once.
unexport PYTHONDONTWRITEBYTECODE
WARM_IMPORTS := import distill.train.trainer, distill.toy.evaluation, distill.report.plots, \
	matplotlib.pyplot, torch.distributed.run, peft, wandb, pytest, xdist; \
	from diffusers import WanPipeline, WanImageToVideoPipeline, AutoencoderKLWan, WanTransformer3DModel; \
	from transformers import UMT5EncoderModel, AutoTokenizer

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt
	$(PY) -c "$(WARM_IMPORTS)"
	@touch $(STAMP)

# The product's headline on the toy teacher (trained on a synthetic world, real Wan 2.2 layout;
# shipped in assets/toy_teacher/): stage 2 of the two-stage recipe, dmd from the shipped stage-1
# student (assets/toy_student_stage1/; stage 1 takes ~16 min, a 700-step stage 1 left dmd at 0.04),
# into a 4-step student. Then the report (eval.json, eval.png: the toy world's scores of the
# teacher at 20 and at 4 steps and of the student) and the summary: a table in the terminal and
# outputs/demo/summary.png. About 3 min on 2 CPU cores.
demo: $(STAMP)
	$(PY) download_wan.py --toy $(DEMO_TEACHER) --overwrite
	rm -rf $(DEMO_OUT) outputs/demo-cache
	$(DEMO_ENV) $(PY) train_distillation.py --method dmd \
		--teacher_path $(DEMO_TEACHER) \
		--student_config config/student_toy_3layer.json \
		--student_init assets/toy_student_stage1 \
		--data_path data/toy_prompts.txt \
		--output_dir $(DEMO_OUT) \
		--cache_dir outputs/demo-cache \
		--height 32 --width 32 --num_frames 1 \
		--teacher_sample_steps 20 \
		--batch_size 16 --num_steps 300 --student_steps 4 --critic_updates 5 \
		--lr 3e-5 --critic_lr 3e-4 --lr_scheduler cosine \
		--log_every 50 --checkpoint_every 0 --seed $(SEED) \
		--save_samples --sample_interval 300 --sample_steps 20 --sample_prompts data/toy_sample_prompts.txt
	$(DEMO_ENV) $(PY) -m distill.evaluate --student $(DEMO_OUT)/student \
		--prompts data/toy_sample_prompts.txt --output_dir $(DEMO_OUT)/eval
	$(DEMO_ENV) $(PY) -m distill.demo $(DEMO_OUT)/eval

# The same on VIDEO: the moving toy world's 9-frame clips, dmd into a 4-step student that starts from
# the teacher's high-noise expert (where a clip's motion is settled; docs/toy-world.md, the moving
# world), against the teacher at its own clip guidance (3 / 1.5: at 4 / 3 its slow clips run fast),
# then the report (the motion figures in eval.json and in a table at the end, toy_clips.gif). About
# 4 min on 2 CPU cores (dmd reads no clean latent: the teacher samples only its 16 reference prompts,
# for the drift and motion metrics; the cache is rebuilt every time, as make demo's is, so a demo just
# runs).
CLIPS_OUT := outputs/demo-clips
demo-clips: $(STAMP)
	$(PY) download_wan.py --toy $(DEMO_TEACHER) --overwrite
	rm -rf $(CLIPS_OUT) outputs/demo-clips-cache
	$(DEMO_ENV) $(PY) train_distillation.py --method dmd \
		--teacher_path $(DEMO_TEACHER) \
		--student_config config/student_toy_3layer.json \
		--student_init teacher --student_init_expert high \
		--data_path data/toy_video_prompts.txt \
		--output_dir $(CLIPS_OUT) \
		--cache_dir outputs/demo-clips-cache \
		--height 32 --width 32 --num_frames 9 \
		--guidance_scale 3 --guidance_scale_2 1.5 \
		--teacher_sample_steps 20 \
		--batch_size 16 --num_steps 300 --student_steps 4 --critic_updates 5 \
		--lr 3e-4 --critic_lr 3e-4 --lr_scheduler cosine \
		--log_every 50 --checkpoint_every 0 --seed $(SEED) \
		--save_samples --sample_interval 300 --sample_steps 20 --sample_prompts data/toy_video_sample_prompts.txt
	$(DEMO_ENV) $(PY) -m distill.evaluate --student $(CLIPS_OUT)/student \
		--prompts data/toy_video_sample_prompts.txt --output_dir $(CLIPS_OUT)/eval

# Image to video: the toy Wan2.2-I2V-A14B teacher (assets/toy_i2v_teacher/) into two 4-step students,
# a small dmd student (the low-noise expert's shape: 5 layers of the teacher's 3 + 5, 36 input
# channels, one transformer for every step; it starts from the shipped stage 1,
# assets/toy_i2v_student_stage1/, rebuilt by `python -m distill.toy.i2v_ship --retrain stage1` in
# ~12 min) and a rank-16 LoRA of the teacher's own experts, both trained
# on images paired with prompts that name only the motion (distill.toy.i2v_data; held-out images
# never among them), at the teacher's guidance (3 / 1.5). Then both are scored against the teacher
# at 20, 4 and 1 steps on 72 held-out images, prompts and noise: the table (image adherence, motion
# ratio, static clips, full-prompt accuracy, diversity gap; the issue's bars met or not) and
# i2v_clips.gif (rows: input image, teacher at 20
# and at 4 steps, each student at 4). The shipped students (assets/toy_i2v_student_dmd/, _lora/) are
# these commands' runs. 8 min 51 s on 2 idle CPU cores; it prints the same table as the students'
# records (measured: every row equal to them, up to 0.02 in the teacher's one-step accuracy).
I2V_TEACHER := outputs/toy-wan-i2v
I2V_OUT := outputs/demo-i2v
I2V_RUN := --teacher_path $(I2V_TEACHER) --data_path $(I2V_OUT)/data/prompts.jsonl \
	--height 32 --width 32 --num_frames 9 --guidance_scale 3 --guidance_scale_2 1.5 \
	--batch_size 16 --student_steps 4 --critic_updates 5 \
	--log_every 50 --checkpoint_every 0 --seed $(SEED)
demo-i2v: $(STAMP)
	$(PY) download_wan.py --toy $(I2V_TEACHER) --toy_kind i2v --overwrite
	rm -rf $(I2V_OUT)
	$(DEMO_ENV) $(PY) -m distill.toy.i2v_data --output $(I2V_OUT)/data --count 512 --seed 1
	$(DEMO_ENV) $(PY) train_distillation.py --method dmd $(I2V_RUN) \
		--student_config config/student_toy_5layer_i2v.json \
		--student_init assets/toy_i2v_student_stage1 --critic_init $(I2V_TEACHER)/transformer_2 \
		--teacher_sample_steps 4 --regression_weight 0.25 \
		--output_dir $(I2V_OUT)/dmd --cache_dir $(I2V_OUT)/cache \
		--num_steps 300 --lr 1e-4 --critic_lr 3e-4 --lr_scheduler cosine
	$(DEMO_ENV) $(PY) train_distillation.py --method dmd $(I2V_RUN) \
		--student_lora_rank 16 --teacher_sample_steps 20 \
		--output_dir $(I2V_OUT)/lora --cache_dir $(I2V_OUT)/cache \
		--num_steps 300
	$(DEMO_ENV) $(PY) -m distill.toy.i2v_students --teacher $(I2V_TEACHER) \
		--student dmd=$(I2V_OUT)/dmd/student --student lora=$(I2V_OUT)/lora/lora \
		--count 72 --output_dir $(I2V_OUT)/eval

# Speed for a user's own model (docs/lora.md, "Speed LoRAs for your own LoRAs"): a user's LoRA of the toy
# teacher (assets/toy_user_lora/, a palette the base world lacks, in the Wan/ComfyUI form) and a 4-step
# speed LoRA distilled against teacher + that LoRA (assets/toy_student_user_lora/), scored against the
# base speed LoRA stacked on it as users do today, on all 216 prompts at two noise seeds; every model
# sampled by stock WanPipeline with the pairs as adapters. Prints the table and its bars from the shipped
# files (`python -m distill.toy.user_table --retrain` distils the speed LoRA again, ~3 min of training).
demo-user-lora: $(STAMP)
	$(DEMO_ENV) $(PY) -m distill.toy.user_table

# Retrains the shipped stage-1 toy student (assets/toy_student_stage1/, where the dmd test and the
# README's toy stage 2 start): velocity distillation at guidance 1, 6,000 steps, ~16 min on one core.
toy-stage1: $(STAMP)
	$(PY) -m distill.toy.stage_one --retrain

# The same stage 1 on the moving world's clips (assets/toy_student_clips_stage1/; ~20 min on one core).
toy-stage1-clips: $(STAMP)
	$(PY) -m distill.toy.stage_one --retrain --clips

# The shipped causal streaming toy student (assets/toy_student_causal/: `python -m distill.toy.causal_ship
# --retrain` in ~12 min; docs/streaming.md) streams the moving world's sample prompts 3x longer than it
# was trained on (33 frames), each chunk's frames written as soon as they are made; it prints the time
# to the first frame and the frames per second. Seconds on 2 CPU cores. What it shows past the 9th frame
# is not a right stream: the toy VAE cannot decode past the trained length, and the student slows to a
# stop there and its colours drift (read through the toy world's stream reader; docs/streaming.md).
# The shipped causal student streams 33 frames (3x its clip: it stalls past 9), then streams its own
# 9 and is continued from the last frame by the shipped 4-step I2V student to 33 (docs/streaming.md).
demo-stream: $(STAMP)
	$(PY) download_wan.py --toy $(DEMO_TEACHER) --overwrite
	$(PY) download_wan.py --toy $(I2V_TEACHER) --toy_kind i2v --overwrite
	rm -rf outputs/demo-stream
	$(DEMO_ENV) $(PY) -m distill.generate --student assets/toy_student_causal --teacher_path $(DEMO_TEACHER) \
		--stream --num_frames 33 --prompts_file data/toy_video_sample_prompts.txt --output outputs/demo-stream/
	$(DEMO_ENV) $(PY) -m distill.generate --student assets/toy_student_causal --teacher_path $(DEMO_TEACHER) \
		--stream --continue_with assets/toy_i2v_student_dmd --num_frames 33 \
		--prompts_file data/toy_video_sample_prompts.txt --output outputs/demo-stream/continued/

# A causal streaming student of the toy clip teacher (ode_init then self_forcing from the shipped dmd
# clip student), streamed at 9 and 33 frames and scored (distill/toy/causal_students.py, the table in
# docs/streaming.md; ~13 min on 2 cores; its 3x rows read through assets/toy_stream_reader/). Not a proof.
toy-causal: $(STAMP)
	rm -rf outputs/toy-causal
	$(DEMO_ENV) $(PY) -m distill.toy.causal_students --output_dir outputs/toy-causal

# The suite on both cores (pytest-xdist; the failure scenarios are rehearsed under load on purpose,
# see distill/stress.py), the error-handling scenarios of test_error_handling.py among them (it also
# runs alone: python test_error_handling.py). Whole modules per worker, in the suite's own order
# (the `long` ones first: tests/conftest.py). Three workers on two cores: a worker that waits (a
# timeout under test, a watchdog's sleep, wandb's retries: ~130 worker-s a run) leaves its core to
# the other two; 807 s against 850 s with two, measured on one fresh clone each.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15 \
		-m "not stress_twin" tests test_error_handling.py; status=$$?; \
		echo "make test: $$(( $$(date +%s) - $(MAKE_START) )) s in all, set-up included"; exit $$status

# The long proofs, not in CI: every shipped toy student (assets/toy_student_*, assets/toy_i2v_student_*)
# trained again from scratch with its recorded command and held to its full bars; the stage-1 students
# must rebuild what is shipped; the toy user LoRA and the speed LoRA distilled against it are trained
# again too (distill/toy/proofs.py; about 100 min on 2 CPU cores; `--ship` replaces the assets). CI
# scores the shipped students and trains each method briefly instead. Run it before landing a change
# to a method, a sampler or the toy world.
proofs: $(STAMP)
	$(DEMO_ENV) $(PY) -m distill.toy.proofs

# On a CUDA machine, what CI cannot run: the gpu-marked tests, the two-rank sharded LoRA run on NCCL
# (two GPUs or more), distill.bench at the 1.3B one-frame preset eager and compiled, the 81-frame rows
# (1.3B student step eager and compiled, A14B LoRA step, teacher forward, each attention backend that
# trains) and the teacher streamed from CPU against a resident one at 81 frames: a table, and
# outputs/gpu-check/gpu_check.json. Without CUDA
# it says so and exits 0 (distill/gpu_check.py).
gpu-check: $(STAMP)
	$(PY) -m distill.gpu_check

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf outputs .pytest_cache
