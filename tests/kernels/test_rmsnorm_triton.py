"""The fused Triton RMSNorm against the plain-torch reference under the CPU interpreter (or compiled on
a GPU: KERNEL_TEST_DEVICE=cuda, see tests/kernel_device.py).

Errors are relative to the largest magnitude of the reference run in fp64 on the same inputs: fp32
reaches ~1e-7; bf16 outputs and input gradients are bf16 tensors, truncated on store by the
interpreter (a GPU rounds to nearest), so up to two bf16 ulps, ~7e-3.
"""
from kernel_device import DEVICE, ON_CUDA  # before triton is first imported: it picks the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import rmsnorm  # noqa: E402
from kernels.rmsnorm import reference  # noqa: E402
from kernels.rmsnorm import triton as fused  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
EPS = 1e-5


# On a GPU only its own tiles: the interpreter's would not fit its registers and shared memory.
@pytest.fixture(params=["gpu"] if ON_CUDA else ["interpreter", "gpu"])
def tiles(request, monkeypatch):
    """Each launch table in turn: the interpreter's large tiles and the GPU's small ones."""
    monkeypatch.setattr(fused, "compiled_for_gpu", lambda device: request.param == "gpu")
    return request.param


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.cpu().double(), expected.cpu().double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1)).item()


def norm_with_grads(fn, x: torch.Tensor, weight: torch.Tensor):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = fn(x, weight, EPS)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)).sum().backward()
    return y, x.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 3, 72), (5, 96), (40, 2048)])
def test_rms_norm_matches_reference(shape, dtype, tiles):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen)
    expected = norm_with_grads(reference.rms_norm, x.double(), weight.double())
    actual = norm_with_grads(fused.rms_norm, x.to(DEVICE), weight.to(DEVICE))
    errors = {name: max_error(a, e) for name, a, e in zip(["y", "d_x", "d_weight"], actual, expected)}
    assert max(errors.values()) <= TOL[dtype], errors
    assert actual[0].dtype == dtype and actual[1].dtype == dtype and actual[2].dtype == torch.float32


@pytest.mark.skipif(ON_CUDA, reason="dispatch on CPU tensors is checked under the interpreter")
def test_dispatcher_takes_the_kernel_only_when_asked_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "rms_norm", lambda *args: calls.append(args))
    x, weight = torch.randn(2, 48), torch.ones(48)
    rmsnorm.rms_norm(x, weight, EPS, impl="auto")
    rmsnorm.rms_norm(x.double(), weight, EPS, impl="triton")
    assert not calls
    rmsnorm.rms_norm(x, weight, EPS, impl="triton")
    assert len(calls) == 1
