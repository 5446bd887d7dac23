"""The fused Triton depth read (phase 1, phase 2) against the plain-torch reference, on the CPU
through the Triton interpreter (or compiled on a GPU: KERNEL_TEST_DEVICE=cuda, see tests/kernel_device.py):
outputs and every gradient, odd sizes, fp32 and bf16, one and two heads.

Errors are measured against the reference run in fp64 on the same (rounded) inputs, relative to the
largest reference magnitude. fp32 reaches ~5e-6 (FP32_TOL). In bf16 the statistics and phase 1's
outputs stay fp32, but phase 2's h and the gradients of bf16 inputs are bf16 tensors; the
interpreter truncates fp32 -> bf16 on store (a GPU rounds to nearest), so those carry up to two bf16
ulps, ~7e-3 (BF16_TOL).
"""
from kernel_device import DEVICE, ON_CUDA  # before triton is first imported: it picks the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import attnres  # noqa: E402
from kernels.attnres import reference  # noqa: E402
from kernels.attnres import triton as fused  # noqa: E402
from model import build_model  # noqa: E402
from trainer.config import load_config  # noqa: E402

FP32_TOL = 1e-5
BF16_TOL = 1e-2
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]

# (B, T, d, heads, sources N, queries S): T = 1; 3 and 5 sources; head widths 48, 36 and 72
# (72 spans two column chunks of 64, the last one partial).
PHASE1_SHAPES = [(1, 1, 48, 1, 3, 1), (2, 3, 72, 2, 5, 3), (1, 5, 72, 1, 3, 3)]
PHASE2_SHAPES = [(1, 1, 48, 1), (2, 3, 72, 2), (1, 5, 72, 1)]


# On a GPU only its own tiles: the interpreter's would not fit its registers and shared memory.
@pytest.fixture(params=["gpu"] if ON_CUDA else ["interpreter", "gpu"])
def tiles(request, monkeypatch):
    """Each launch table in turn: the interpreter's large tiles, and the GPU's (small tiles, several
    column chunks per head, more programs), whose arithmetic is checked here like the interpreter's."""
    monkeypatch.setattr(fused, "compiled_for_gpu", lambda device: request.param == "gpu")
    return request.param


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.cpu().double(), expected.cpu().double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1)).item()


def run_with_grads(fn, inputs: list[torch.Tensor], n_differentiable: int) -> list[torch.Tensor]:
    """Outputs of fn(*inputs) and the gradients of a fixed random linear loss on the first
    n_differentiable outputs, with respect to every input."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    outputs = fn(*inputs)
    gen = torch.Generator().manual_seed(1)
    loss = sum((out * torch.randn(out.shape, generator=gen).to(out.device, out.dtype)).sum()
               for out in outputs[:n_differentiable])
    loss.backward()
    return [*outputs, *(x.grad for x in inputs)]


def assert_matches(actual: list, expected: list, names: list[str], tol: float):
    errors = {name: max_error(a, e) for name, a, e in zip(names, actual, expected, strict=True)}
    assert max(errors.values()) <= tol, errors


def phase1_inputs(B, T, d, H, N, S, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [(torch.randn(B, T, d, generator=gen) * (i + 1)).to(dtype) for i in range(N)]
    return blocks, torch.randn(S, H, d // H, generator=gen)


def check_phase1(blocks, queries, eps, tol):
    H = queries.shape[1]

    def reference_phase1(queries, *blocks):
        inv_rms = None if eps is None else [reference.inverse_rms(b, H, eps) for b in blocks]
        return reference.phase1(list(blocks), queries, inv_rms)

    expected = run_with_grads(reference_phase1, [queries.double(), *(b.double() for b in blocks)], 3)
    on_device = [x.to(DEVICE) for x in [queries, *blocks]]
    actual = run_with_grads(lambda q, *bs: fused.phase1(list(bs), q, eps), on_device, 3)
    names = ["o", "m", "l", "scores", "d_queries", *(f"d_block{i}" for i in range(len(blocks)))]
    assert_matches(actual, expected, names, tol)


@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PHASE1_SHAPES)
def test_phase1_matches_reference(shape, dtype, key_norm, tiles):
    blocks, queries = phase1_inputs(*shape, dtype)
    check_phase1(blocks, queries, EPS if key_norm else None, TOL[dtype])


def test_phase1_zero_queries_split_max_gradient_between_ties():
    # Zero-initialised queries score every source 0: all tie for the max, as at step 0 of training.
    blocks, queries = phase1_inputs(2, 3, 48, 2, 5, 3, torch.float32)
    check_phase1(blocks, torch.zeros_like(queries), EPS, FP32_TOL)


def test_phase1_casts_an_fp32_embedding_among_bf16_blocks():
    # Under autocast the embedding stays fp32 while block sums are bf16; the kernel reads it as bf16.
    # That rounding costs up to 1.5e-2 here, as much as the reference run on these bf16/fp32 inputs
    # loses itself (1.6e-2: it rounds each bf16 block's scores to bf16).
    blocks, queries = phase1_inputs(2, 3, 72, 2, 3, 3, torch.bfloat16)
    blocks[0] = blocks[0].float() + 0.01  # not representable in bf16
    check_phase1(blocks, queries, EPS, 2e-2)


@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PHASE2_SHAPES)
def test_phase2_matches_reference(shape, dtype, key_norm, tiles):
    B, T, d, H = shape
    eps = EPS if key_norm else None
    gen = torch.Generator().manual_seed(0)
    o1 = torch.randn(B, T, d, generator=gen) * 3
    m1 = torch.randn(B, T, H, generator=gen)
    l1 = torch.rand(B, T, H, generator=gen) * 3 + 1  # a softmax sum over >= 1 source with the max
    partial = (torch.randn(B, T, d, generator=gen) * 2).to(dtype)
    query = torch.randn(H, d // H, generator=gen)

    def reference_phase2(o1, m1, l1, partial, query):
        inv_rms = None if eps is None else reference.inverse_rms(partial, H, eps)
        return reference.phase2(o1, m1, l1, partial, query, inv_rms)

    inputs = [o1, m1, l1, partial, query]
    expected = run_with_grads(reference_phase2, [x.double() for x in inputs], 1)
    actual = run_with_grads(lambda *xs: fused.phase2(*xs, eps), [x.to(DEVICE) for x in inputs], 1)
    names = ["h", "scores", "d_o1", "d_m1", "d_l1", "d_partial", "d_query"]
    assert_matches(actual, expected, names, TOL[dtype])


@pytest.mark.skipif(ON_CUDA, reason="dispatch on CPU tensors is checked under the interpreter")
def test_dispatcher_takes_the_kernels_only_when_asked_and_able(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "phase1", lambda *args: calls.append(args))
    blocks, queries = phase1_inputs(1, 2, 48, 1, 3, 2, torch.float32)
    attnres.phase1(blocks, queries, EPS, impl="auto")
    attnres.phase1(blocks, queries, EPS, kernel="sigmoid", impl="triton")
    attnres.phase1([b.double() for b in blocks], queries.double(), EPS, impl="triton")
    assert not calls
    attnres.phase1(blocks, queries, EPS, impl="triton")
    assert len(calls) == 1
    with pytest.raises(ValueError, match="impl='cuda'"):
        attnres.phase1(blocks, queries, EPS, impl="cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attnres.phase1(blocks, queries, EPS, impl="triton")


# -- the model ---------------------------------------------------------------------------------------

# Relative to the largest entry. The whole model amplifies rounding: with random, sharp depth queries and
# the scaled init's unit-std embedding, two exact reference paths (two-phase vs per-layer read) already
# differ by 7.6e-5 in the gradients (1.2e-5 under the flat init). A wrong kernel errs by O(1).
MODEL_TOL = 2e-4


def model_logits_and_grads(impl: str, heads: int):
    torch.manual_seed(0)
    cfg = load_config(["model=xs", "variant=block", "variant.block_size=3", "variant.two_phase=true",
                       f"variant.heads={heads}", f"model.kernel_impl={impl}"])
    model = build_model(cfg).to(DEVICE)
    with torch.no_grad():  # random queries and gains: zero-init would make every read uniform
        for name, p in model.named_parameters():
            if name.endswith(".query") or "key_norm" in name:
                p.copy_(torch.randn_like(p))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits = model(tokens)
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("heads", [1, 2])
def test_model_with_triton_kernels_matches_reference(heads, monkeypatch):
    calls = {"phase1": 0, "phase2": 0}
    for name in calls:
        kernel = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _k=kernel, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _k(*a))
    logits, grads = model_logits_and_grads("triton", heads)
    assert calls["phase1"] > 0 and calls["phase2"] > 0, calls
    ref_logits, ref_grads = model_logits_and_grads("torch", heads)
    assert max_error(logits, ref_logits) <= MODEL_TOL
    assert grads.keys() == ref_grads.keys()
    errors = {name: max_error(grads[name], ref_grads[name]) for name in grads}
    assert max(errors.values()) <= MODEL_TOL, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
