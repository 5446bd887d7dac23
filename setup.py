from setuptools import find_packages, setup

setup(
    name="attnres",
    version="0.1.0",
    description="Distributed LLM pretraining with Attention Residuals (AttnRes)",
    python_requires=">=3.10",
    packages=find_packages(include=["model*", "kernels*", "parallel*", "trainer*", "scripts*"]),
    install_requires=[
        # Pinned: the pipelining engine and DCP are used through APIs that still move between releases.
        "torch==2.13.0",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "numpy>=1.24",
        "tokenizers>=0.19",
        "tqdm>=4.66",
        "wandb>=0.17",
    ],
    extras_require={
        # triton runs the fused kernels on CPU under TRITON_INTERPRET=1, which is how the tests use it.
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "triton>=3.4,<4"],
        "gpu": ["triton>=3.4,<4", "flash-linear-attention"],
        "megatron": ["megatron-core"],
    },
)
