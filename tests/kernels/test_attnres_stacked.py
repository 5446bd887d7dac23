"""The stacked reads (few tokens: decoding) against the one-source-at-a-time reference: outputs and
all gradients, both kernels, with and without key norm, one and two heads, mixed dtypes."""
import pytest
import torch

from kernels import attnres
from kernels.attnres import reference


def make_sources(n, shape, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_() for _ in range(n)]


def grads(outputs, inputs):
    total = sum((o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view_as(o)).sum()
                for o in outputs)
    return torch.autograd.grad(total, inputs, retain_graph=True)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_stacked_equals_phase1(kernel, key_norm, heads):
    blocks = make_sources(5, (2, 3, 8))
    queries = torch.randn(3, heads, 8 // heads, dtype=torch.float64, requires_grad=True)
    inv_rms = [attnres.inverse_rms(b, heads, 1e-6) for b in blocks] if key_norm else None
    expected = reference.phase1(blocks, queries, inv_rms, kernel)
    got = reference.phase1_stacked(blocks, queries, inv_rms, kernel)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    inputs = [*blocks, queries]
    for e, g in zip(grads(expected, inputs), grads(got, inputs)):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "sigmoid"])
@pytest.mark.parametrize("token_query", [False, True])
@pytest.mark.parametrize("heads", [1, 2])
def test_depth_attention_stacked_equals_depth_attention(kernel, token_query, heads):
    sources = make_sources(4, (2, 3, 8))
    shape = (2, 3, heads, 8 // heads) if token_query else (heads, 8 // heads)
    query = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    inv_rms = [attnres.inverse_rms(s, heads, 1e-6) for s in sources]
    expected = reference.depth_attention(sources, query, inv_rms, kernel)
    got = reference.depth_attention_stacked(sources, query, inv_rms, kernel)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    inputs = [*sources, query]
    for e, g in zip(grads(expected, inputs), grads(got, inputs)):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_stacked_reads_take_an_fp32_embedding_among_bf16_blocks():
    blocks = [make_sources(1, (1, 1, 8), torch.float32)[0]] + make_sources(3, (1, 1, 8), torch.bfloat16, seed=1)
    queries = torch.randn(2, 1, 8)
    o, m, l, _ = reference.phase1_stacked(blocks, queries, None)
    o_ref, m_ref, l_ref, _ = reference.phase1([b.float() for b in blocks], queries, None)
    torch.testing.assert_close(o / l.unsqueeze(-1), o_ref / l_ref.unsqueeze(-1))


def test_dispatcher_stacks_only_for_few_tokens(monkeypatch):
    calls = []
    monkeypatch.setattr(attnres, "phase1_stacked", lambda *a: calls.append("stacked") or reference.phase1(*a))
    queries = torch.zeros(2, 1, 8)
    attnres.phase1(make_sources(3, (1, attnres.STACK_MAX_TOKENS, 8), torch.float32), queries, None, impl="torch")
    attnres.phase1(make_sources(3, (1, attnres.STACK_MAX_TOKENS + 1, 8), torch.float32), queries, None,
                   impl="torch")
    assert calls == ["stacked"]
