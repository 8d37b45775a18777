# `make demo` and `make test` set everything up on a fresh machine: they create .venv when it is
# missing and (re)install requirements.txt whenever it changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-requirements

DEMO_TEACHER := outputs/toy-wan
DEMO_OUT := outputs/demo

.PHONY: demo test lint format clean toy-stage1

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $(STAMP)

# Copies the toy teacher (trained on a synthetic world, real Wan 2.2 layout; shipped in
# assets/toy_teacher/), distils a student from it (text-embedding cache, teacher-sampled clean
# latents, training, checkpoints, export, sample grids), then scores teacher and student by what
# their pictures show (eval.json "toy").
demo: $(STAMP)
	$(PY) download_wan.py --toy $(DEMO_TEACHER)
	rm -rf $(DEMO_OUT) outputs/demo-cache
	$(PY) train_distillation.py \
		--teacher_path $(DEMO_TEACHER) \
		--student_config config/student_toy.json \
		--data_path data/toy_prompts.txt \
		--output_dir $(DEMO_OUT) \
		--cache_dir outputs/demo-cache \
		--height 32 --width 32 --num_frames 1 \
		--teacher_sample_steps 20 \
		--batch_size 16 --num_steps 1000 --lr 5e-3 --lr_warmup_steps 50 \
		--log_every 50 --checkpoint_every 500 --ema_decay 0.99 --seed 0 \
		--save_samples --sample_interval 500 --sample_steps 20 --sample_prompts data/toy_sample_prompts.txt
	$(PY) -m distill.evaluate --student $(DEMO_OUT)/student --teacher_path $(DEMO_TEACHER) \
		--prompts data/toy_sample_prompts.txt --output_dir $(DEMO_OUT)/eval \
		--height 32 --width 32 --steps 20 --num_buckets 10

# Retrains the shipped stage-1 toy student (assets/toy_student_stage1/, where the dmd test and the
# README's toy stage 2 start): velocity distillation at guidance 1, 6,000 steps, ~17 min on one core.
toy-stage1: $(STAMP)
	$(PY) -m distill.toy.stage_one --retrain

# The suite on both cores (pytest-xdist; the failure scenarios are rehearsed under load on purpose,
# see distill/stress.py), then the error-handling scenarios as users run them, as a plain command.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --durations=15
	$(PY) test_error_handling.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf outputs .pytest_cache
