# `make demo` and `make test` set everything up on a fresh machine: they create .venv when it is
# missing and (re)install requirements.txt whenever it changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-requirements

DEMO_TEACHER := outputs/tiny-wan
DEMO_OUT := outputs/demo

.PHONY: demo test lint format clean

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $(STAMP)

# Builds the tiny random teacher (real Wan 2.2 layout), then runs a full distillation on it:
# text-embedding cache, teacher-sampled clean latents, training, checkpoints, export.
demo: $(STAMP)
	$(PY) download_wan.py --tiny $(DEMO_TEACHER)
	rm -rf $(DEMO_OUT)
	$(PY) train_distillation.py \
		--teacher_path $(DEMO_TEACHER) \
		--student_config config/student_tiny.json \
		--data_path data/static_prompts.txt \
		--output_dir $(DEMO_OUT) \
		--cache_dir outputs/demo-cache \
		--height 32 --width 32 --num_frames 1 \
		--teacher_sample_steps 8 \
		--batch_size 4 --num_steps 600 --lr 3e-3 --lr_warmup_steps 20 \
		--log_every 20 --checkpoint_every 100 --ema_decay 0.99 --seed 0 \
		--save_samples --sample_interval 200 --sample_steps 8 --eval_interval 600

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf outputs .pytest_cache
