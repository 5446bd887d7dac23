# Entry points. `make test` and `make train` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the local torch wheel; GPU machines override, e.g. make TORCH_SPEC='torch==2.13.0 --index-url ...'
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast train compare bench corpus clean compat gpu-bundle

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n 2 --durations=25 tests

# What to run while you work (under 2 minutes on 2 cores): every test that starts no torchrun launch, runs no
# lm_eval evaluation, compiles nothing and is not marked slow (pytest.ini's markers). `make test` runs them all.
test-fast: setup
	$(PY) -m pytest -q -n 2 --durations=10 -m "not launch and not lm_eval and not compile and not slow" tests

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
	$(PY) -m scripts.bench step

# `make corpus`: the larger real corpus (Shakespeare, the Python standard library, Debian's King James Bible
# and GCIDE dictionary; about 50 MB of text) prepared as a weighted blend with one BPE; it prints the
# data.blend override that trains on it. make train keeps its Shakespeare default.
corpus: setup
	$(PY) -m scripts.corpus $(CORPUS_ARGS)

# `make compat TORCH=2.11.0`: the named subset below on another torch release (setup.py allows 2.11 to
# 2.15), in a side venv .compat/<release> on Python 3.12 as the lent GPU machines have it, torch and the
# project's dependencies from the index. What differs between torch releases is in parallel/compat.py;
# the triton internals the ahead-of-time compile uses (triton 3.6 to 3.9) are in kernels/aot.py.
# PIP_CONFIG_FILE=/dev/null: this machine's pip config caps torch at 2.14.1.
# The CUDA build of torch (the index's only one for some releases, about 4.6 GB) runs on the CPU.
TORCH ?=
COMPAT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) python3.12)
COMPAT_VENV = .compat/$(TORCH)
# Kernels under the interpreter (with the triton that torch release brings) and compiled ahead of time
# for sm_80 and sm_90a; one-process training, bf16 and resume (DCP); MLA's causal_lower_right; pp2_vp2 with the
# cross-stage block cache; fsdp2 from meta and dp2_ep2 (DDP, ep's autograd all-to-all), each both ways with
# one process; compiled blocks; cached and compiled generation; the safetensors and Hugging Face exports; K3's
# MoE options and the Kimi release import (compressed-tensors under that torch).
# (parallel.cp > 1 is refused before torch 2.13: parallel/compat.py.)
COMPAT_TESTS ?= tests/kernels/test_attnres_triton.py tests/kernels/test_rmsnorm_triton.py tests/kernels/test_kda.py \
	"tests/kernels/test_aot.py::test_every_tile_configuration_compiles_without_spills[80]" \
	"tests/kernels/test_aot.py::test_every_tile_configuration_compiles_without_spills[90]" \
	tests/trainer/test_trainer.py::test_stop_and_resume_gives_the_uninterrupted_losses_bitwise \
	tests/trainer/test_trainer.py::test_bf16_loss_falls_and_resumes_bitwise_and_its_checkpoint_continues_in_fp32 \
	tests/model/test_mla.py tests/parallel/test_pipeline.py::test_checkpoints_move_between_pp_and_single_process \
	tests/parallel/test_fsdp.py::test_fsdp2_trains_like_one_process_and_checkpoints_move_both_ways \
	"tests/parallel/test_pipeline.py::test_expert_parallel_trains_like_one_process_and_resumes_in_one_process[dp2_ep2-extra1]" \
	tests/trainer/test_compile.py::test_compiled_blocks_train_with_the_eager_losses tests/model/test_generation.py \
	tests/inference/test_export.py tests/inference/test_hf_export.py tests/model/test_moe_release.py \
	tests/inference/test_kimi_release.py

compat:
	@test -n "$(TORCH)" || { echo "make compat: name a torch release, e.g. make compat TORCH=2.11.0" >&2; exit 2; }
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	PIP_CONFIG_FILE=/dev/null $(COMPAT_VENV)/bin/python -m pip install -q "torch==$(TORCH)" -e '.[dev]'
	# Triton's interpreter before 3.7 (torch 2.11 pins 3.6) takes int() of one-element arrays, an error from numpy 2.4.
	$(COMPAT_VENV)/bin/python -c "import sys, triton; sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) < (3, 7))" \
		|| PIP_CONFIG_FILE=/dev/null $(COMPAT_VENV)/bin/python -m pip install -q "numpy<2.4"
	$(COMPAT_VENV)/bin/python -c "import sys, torch, triton; print('compat: torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

# `make gpu-bundle`: the wheels a lent GPU machine lacks (it has torch 2.11 with triton 3.6, transformers,
# tokenizers, safetensors, numpy, einops, pyarrow, tqdm, pytest, pytest-xdist, matplotlib, huggingface_hub,
# and reaches no index), for CPython 3.12 on manylinux x86-64, into .gpu/wheels; scripts/gpu_check.sh
# installs them there without an index. --no-deps: each missing dependency is named here (from the index:
# PIP_CONFIG_FILE=/dev/null leaves out this machine's local wheel folders). fla-core holds
# fla.ops (chunk_kda), all we use of flash-linear-attention. wandb stays out (a dozen dependencies; imported
# only when logging.wandb.mode is not disabled), as does lm-eval (inference.evaluate only). omegaconf 2.3
# needs antlr4-python3-runtime 4.9, published only as a source archive: built here into a pure-Python wheel.
# torchao: train.float8 and scripts/gpu_checks/float8_step.py (3.3 MiB).
GPU_WHEELS := .gpu/wheels
GPU_BUNDLE := "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" "megatron-core>=0.16,<0.17" "zstandard>=0.22" "fla-core>=0.6" \
	"torchao>=0.18,<0.19"
GPU_BUNDLE_MAX_MIB := 40

gpu-bundle: setup
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	PIP_CONFIG_FILE=/dev/null $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_BUNDLE)
	PIP_CONFIG_FILE=/dev/null $(PY) -m pip wheel -q --no-deps -w $(GPU_WHEELS) "antlr4-python3-runtime==4.9.3"
	@$(PY) -c "import pathlib, sys; wheels = sorted(pathlib.Path('$(GPU_WHEELS)').glob('*.whl')); \
		total = sum(w.stat().st_size for w in wheels) / 2**20; \
		print('\n'.join(f'{w.stat().st_size / 2**20:7.2f} MiB  {w.name}' for w in wheels)); \
		print(f'gpu-bundle: {len(wheels)} wheels, {total:.1f} MiB in all (at most $(GPU_BUNDLE_MAX_MIB) MiB) in $(GPU_WHEELS)'); \
		sys.exit(total > $(GPU_BUNDLE_MAX_MIB))"
