# The two commands users need: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup lint test demo checkpoints bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch==2.13.0 in the same pip command as the rest, so nothing pulls a CUDA build.
	# --no-compile: with byte-compilation of every installed module (torch has thousands) this
	# install took 110 s here, without it 44 s; Python compiles what it imports on first use.
	$(PY) -m pip install --no-compile torch==2.13.0 -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Lint and type-check ddrl/ (configured in pyproject.toml); a new finding fails `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check ddrl
	$(VENV)/bin/mypy

test: lint
	# Tiny models gain nothing from threads, and torchrun tests start several processes: one thread each.
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q -p no:cacheprovider --durations=15

demo: $(STAMP)
	# One BLAS thread: the tiny model gains little from two, and thread contention can cost 10x.
	# SyntaxWarnings: a reasoning-gym dependency (cellpylib) warns when first compiled (--no-compile).
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::SyntaxWarning $(VENV)/bin/ddrl demo

checkpoints: $(STAMP)
	$(PY) -m ddrl.training.make_checkpoints

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) runs
