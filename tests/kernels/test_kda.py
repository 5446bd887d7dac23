"""The chunkwise KDA kernel against the token-by-token recurrence, in fp32."""
import pytest
import torch
import torch.nn.functional as F

from kernels.kda import kda_chunk, kda_chunk_from_unknown_start, kda_recurrent

B, H, K, V = 2, 2, 16, 12
SCALE = K ** -0.5


def make_inputs(T: int, seed: int = 0, decay_strength: float = 1.0):
    """Normalised q, k; beta in (0, 1); per-channel log decays spanning slow (~-0.01) to fast (several
    units per token) channels, like -exp(A_log) * softplus(.) at init."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    rate = torch.empty(H, 1).uniform_(1, 16, generator=gen) * decay_strength
    g = -rate * F.softplus(torch.randn(B, T, H, K, generator=gen) - 3)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("T", [1, 37, 64, 100, 130])
def test_chunk_matches_recurrent_forward_and_state(T, chunk_size):
    q, k, v, g, beta = make_inputs(T)
    state0 = torch.randn(B, H, K, V)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, SCALE, state0, output_final_state=True)
    o, s = kda_chunk(q, k, v, g, beta, SCALE, chunk_size, state0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("T", [37, 100])
def test_chunk_matches_recurrent_gradients(T, chunk_size):
    inputs = make_inputs(T, seed=1)
    gen = torch.Generator().manual_seed(2)
    grad_o = torch.randn(B, T, H, V, generator=gen)
    grad_s = torch.randn(B, H, K, V, generator=gen)

    def grads(kernel, **kwargs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o, s = kernel(*leaves, SCALE, output_final_state=True, **kwargs)
        torch.autograd.backward([o, s], [grad_o, grad_s])
        return [leaf.grad for leaf in leaves]

    for name, got, want in zip("q k v g beta".split(), grads(kda_chunk, chunk_size=chunk_size), grads(kda_recurrent)):
        # fp32 sums over up to T terms: 1e-4 absolute against gradients of order 1-10.
        torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=0, msg=name)


def test_strong_decay_stays_finite():
    """Cumulative log decays of thousands within a chunk must not overflow (no inf * 0)."""
    inputs = [t.requires_grad_() for t in make_inputs(100, decay_strength=100.0)]
    o, _ = kda_chunk(*inputs, SCALE, 64)
    o_ref, _ = kda_recurrent(*(t.detach() for t in inputs), SCALE)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    o.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)


@pytest.mark.parametrize("split", [1, 30, 64, 99])
def test_state_passing_continues_the_sequence(split):
    q, k, v, g, beta = make_inputs(100, seed=3)
    o_whole, s_whole = kda_chunk(q, k, v, g, beta, SCALE, 64, output_final_state=True)
    first = [t[:, :split] for t in (q, k, v, g, beta)]
    rest = [t[:, split:] for t in (q, k, v, g, beta)]
    o1, s1 = kda_chunk(*first, SCALE, 64, output_final_state=True)
    o2, s2 = kda_chunk(*rest, SCALE, 64, initial_state=s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(s2, s_whole, atol=1e-5, rtol=0)


def test_output_dtype_follows_input():
    q, k, v, g, beta = (t.bfloat16() for t in make_inputs(20))
    o, s = kda_chunk(q, k, v, g, beta, SCALE, 16, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_chunk_gradcheck_in_fp64(monkeypatch):
    """The decayed gram has a hand-written backward: check it, and everything around it, against finite
    differences. Sub-chunks of 4 in chunks of 12 keep it small: three sub-chunks in a full chunk, a
    partial last chunk, and a given initial state."""
    monkeypatch.setattr("kernels.kda.chunk.SUB_CHUNK", 4)
    q, k, v, g, beta = make_inputs(17, seed=4)
    inputs = [t[:1, :, :1, :4] for t in (q, k, v, g)] + [beta[:1, :, :1]]  # B = H = 1, K = V = 4
    state0 = torch.randn(1, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    leaves = [t.double().requires_grad_() for t in inputs + [state0]]

    def run(q, k, v, g, beta, state0):
        return kda_chunk(q, k, v, g, beta, SCALE, 12, state0, output_final_state=True)

    assert torch.autograd.gradcheck(run, leaves)


def pieces_in_order(inputs, bounds, chain: bool):
    """Run kda_chunk_from_unknown_start on consecutive pieces [bounds[i], bounds[i+1]) of the sequence, each
    piece's start state chained from the earlier pieces' (final state from zero, transition) as context
    parallelism's ranks do; chain=False starts every piece from zero (the negative control)."""
    carried = torch.zeros(B, H, K, V)
    outputs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        def start_state(final, transition):
            nonlocal carried
            start = carried if chain else torch.zeros_like(carried)
            carried = transition @ carried + final  # (B, H, K, V)
            return start
        piece = [t[:, lo:hi] for t in inputs]
        outputs.append(kda_chunk_from_unknown_start(*piece, SCALE, 16, start_state))
    return torch.cat(outputs, dim=1)  # (B, T, H, V)


@pytest.mark.parametrize("bounds", [(0, 50, 100), (0, 7, 40, 41, 100)])
def test_pieces_with_chained_start_states_equal_the_whole_sequence(bounds):
    """Context parallelism's KDA: outputs and the gradients of q, k, v, g, beta equal one run over the whole
    sequence; starting each piece from zero instead is off by orders of magnitude more."""
    inputs = make_inputs(100, seed=4)
    grad_o = torch.randn(B, 100, H, V, generator=torch.Generator().manual_seed(5))

    def run(kernel):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o = kernel(leaves)
        o.backward(grad_o)
        return o.detach(), [leaf.grad for leaf in leaves]

    o_whole, grads_whole = run(lambda leaves: kda_chunk(*leaves, SCALE, 16)[0])
    o_split, grads_split = run(lambda leaves: pieces_in_order(leaves, bounds, chain=True))
    torch.testing.assert_close(o_split, o_whole, atol=2e-5, rtol=0)
    for name, got, want in zip("q k v g beta".split(), grads_split, grads_whole):
        torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=0, msg=name)
    unchained = pieces_in_order(inputs, bounds, chain=False)
    assert (unchained - o_whole).abs().max() > 1e-2
