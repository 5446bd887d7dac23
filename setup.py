from setuptools import find_packages, setup

# inference.evaluate (lm-evaluation-harness as a library) and inference.export format=hf. transformers is held
# to one minor release: the exported model's generate() goes through its cache hand-off, which still moves.
# datasets 4 stopped running dataset loading scripts: an include_path task's dataset_path is then data, not code
# (inference/evaluate.py); lm-eval itself accepts datasets from 2.16.
EVAL = ["transformers>=5.24,<5.25", "lm-eval>=0.4.13,<0.5", "datasets>=4"]
# Reading and writing the released Kimi models (trainer/kimi/, inference/kimi/): compressed-tensors dequantises
# K3's MXFP4 experts (mxfp4-pack-quantized as a format of its own from 0.18; it needs torch >= 2.10 and
# transformers >= 4.45, so it keeps our torch and transformers), tiktoken reads a release's tiktoken.model for
# transformers' TikTokenConverter.
KIMI = ["compressed-tensors>=0.18,<0.21", "tiktoken>=0.7,<1", *EVAL]

setup(
    name="attnres",
    version="0.1.0",
    description="Distributed LLM pretraining with Attention Residuals (AttnRes)",
    python_requires=">=3.10",
    packages=find_packages(include=["model*", "kernels*", "parallel*", "trainer*", "inference*", "scripts*"]),
    install_requires=[
        # 2.11 (the CUDA images we are lent) through 2.15, the newest release; what moved between them is
        # in parallel/compat.py, and `make compat TORCH=<version>` runs a subset of the suite on one. CI
        # tests 2.13.0 (the Makefile's TORCH_SPEC).
        "torch>=2.11,<2.16",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "numpy>=1.24",
        "tokenizers>=0.20",  # Tokenizer.encode_batch_fast (trainer/data/prepare.py)
        # trainer/data/text_inputs.py: reading .parquet and .jsonl.zst inputs (imported only for those).
        "pyarrow>=14",
        "zstandard>=0.22",
        # inference.export / inference.generate: weights in a format that holds only tensors (no pickle).
        "safetensors>=0.4",
        # inference.export format=hf: split_torch_state_dict_into_shards (also a dependency of tokenizers).
        "huggingface_hub>=0.23",
        # The data layer: Megatron's .bin/.idx format, its blends, splits, sample indices and index cache
        # (GPTDataset, BlendedMegatronDatasetBuilder). 0.16 is the release its use here was checked against.
        "megatron-core>=0.16,<0.17",
        "tqdm>=4.66",
        "wandb>=0.17",
        # scripts/report: the comparison report's figures (Agg backend, no display needed) and the Student-t
        # quantile of its paired intervals.
        "matplotlib>=3.7",
        "scipy>=1.10",
        # train.float8 (parallel/float8.py, imported only there): torchao's float8 training. 0.18's compiled
        # parts target torch >= 2.11; the float8 path we use is Python over torch._scaled_mm.
        "torchao>=0.18,<0.19",
    ],
    extras_require={
        # The tests run the Triton kernels on CPU under TRITON_INTERPRET=1 (CI: triton 3.9; 3.6, which torch
        # 2.11's CUDA build pins, by `make compat`), and the evaluation and Hugging Face export tests need
        # the eval extra.
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "filelock>=3.0", "triton>=3.6,<4", *KIMI],
        "eval": EVAL,
        "kimi": KIMI,
        # CUDA builds of torch bring the triton they were built with; this only bounds it.
        "gpu": ["triton>=3.4,<4", "flash-linear-attention"],
    },
)
