"""Where the Triton kernel tests run: import this before triton.

Default: CPU tensors under the Triton interpreter (TRITON_INTERPRET=1). KERNEL_TEST_DEVICE=cuda (as
scripts/gpu_check.sh sets it, with TRITON_INTERPRET unset): CUDA tensors and the compiled kernels.
"""
import os

import torch

DEVICE = os.environ.get("KERNEL_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"KERNEL_TEST_DEVICE={DEVICE} is not one of cpu | cuda")
if DEVICE == "cuda":
    if not torch.cuda.is_available():
        raise RuntimeError("KERNEL_TEST_DEVICE=cuda but torch sees no CUDA device")
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        raise RuntimeError("KERNEL_TEST_DEVICE=cuda tests the compiled kernels: unset TRITON_INTERPRET")
else:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the kernels run on the CPU

ON_CUDA = DEVICE == "cuda"
