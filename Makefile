# Entry points. `make test` and `make train` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the local torch wheel; GPU machines override, e.g. make TORCH_SPEC='torch==2.13.0 --index-url ...'
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test train compare bench corpus clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n 2 --durations=25 tests

clean:
	rm -rf $(VENV) .pytest_cache

# `make train`: Block AttnRes at model=s on the Shakespeare corpus, 2 processes under torchrun running
# interleaved 1F1B (pp=2, vp=2) with the cross-stage block cache. Extra Hydra overrides go in ARGS,
# e.g. make train ARGS="variant=full train.steps=300"; LAYOUT="parallel=dp2" for plain data parallelism.
NPROC ?= 2
RUN_DIR ?= runs/train
LAYOUT ?= parallel=pp2_vp2 train.micro_batch=4
ARGS ?=
THREADS := $(shell n=$$(nproc); t=$$((n / $(NPROC))); [ $$t -ge 1 ] && echo $$t || echo 1)

train: setup
	$(PY) -m trainer.check --nproc $(NPROC) run.dir=$(RUN_DIR) $(LAYOUT) $(ARGS)
	OMP_NUM_THREADS=$(THREADS) $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		-m trainer.main run.dir=$(RUN_DIR) $(LAYOUT) $(ARGS)

# `make compare`: baseline vs Full vs Block AttnRes at model=xs (experiment quick, about 10 minutes on
# 2 cores) -> reports/quick/report.md. EXPERIMENT=cpu_repro|ablations|scaling for the other grids;
# ARGS for overrides, e.g. make compare ARGS="seeds=[0,1,2]". Finished runs are skipped, others resume.
# One thread by default: on a shared 2-core machine two OpenMP threads spin at their barriers whenever
# other work holds a core (single steps 30x slower, measured); COMPARE_THREADS=2 on an idle machine.
EXPERIMENT ?= quick
COMPARE_THREADS ?= 1

compare: setup
	OMP_NUM_THREADS=$(COMPARE_THREADS) $(PY) -m scripts.compare experiment=$(EXPERIMENT) $(ARGS)

bench: setup
	$(PY) -m scripts.bench_step

# `make corpus`: the larger real corpus (Shakespeare, the Python standard library, Debian's King James Bible
# and GCIDE dictionary; about 50 MB of text) prepared as a weighted blend with one BPE; it prints the
# data.blend override that trains on it. make train keeps its Shakespeare default.
corpus: setup
	$(PY) -m scripts.corpus $(CORPUS_ARGS)
