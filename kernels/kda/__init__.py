"""Kimi Delta Attention kernels in pure PyTorch: chunkwise for training and prefill, recurrent for decode."""
from kernels.kda.chunk import kda_chunk
from kernels.kda.recurrent import kda_recurrent

__all__ = ["kda_chunk", "kda_recurrent"]
