"""Document masking (issue 27, item 4): no token sees an earlier document of its packed window.

Tolerances. A masked computation and the same documents run alone differ only in the order of their sums
(another chunk alignment in KDA, other GEMM shapes), each rounding by a few units u of its precision.
- The kernels, MLA and the short convolution run in float64 here (u = 2^-53 ~ 1.1e-16): outputs of O(1)
  after at most a few hundred chained operations stay within 1e-10 (about 1e6 u of headroom).
- The KDA layer casts q, k, beta and the decay to fp32 (u = 2^-24 ~ 6e-8) whatever the model's dtype, so
  what passes through it is compared relative to its scale: within REL_KDA = 1e-4. Measured: 2e-7 at the
  layer; on the decoder's logits 5e-9 (baseline) and 3.3e-6 (block, whose random depth queries amplify the
  KDA rounding: the masked and unmasked paths on a single document differ by as much, 4e-6).
A leak across a boundary moves outputs by more than 1e-2 of their scale (asserted as negative controls:
measured 2.6e-2 relative on the baseline's logits, 1.0 on the layers and on block's logits).
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.kda import kda_chunk, kda_recurrent, varlen_offsets
from model import build_model
from model.config import KDAConfig, MLAConfig, ModelConfig
from model.document_masking import document_starts, same_document_causal_mask, same_document_window
from model.init import initialise
from model.kda import KimiDeltaAttention, _short_conv
from model.mla import MultiHeadLatentAttention
from trainer.config import load_config

TOL = 1e-10
REL_KDA = 1e-4
LEAK = 1e-2
EOT = 0
B, H, K, V = 2, 2, 8, 6


def starts_at(length: int, *rows: list[int]) -> torch.Tensor:
    """(len(rows), length) bool with True at the given positions of each row."""
    starts = torch.zeros(len(rows), length, dtype=torch.bool)
    for row, positions in enumerate(rows):
        starts[row, positions] = True
    return starts


def segments(starts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, begin, end) of every document of every row."""
    offsets = varlen_offsets(starts).tolist()
    T = starts.shape[1]
    return [(a // T, a % T, a % T + (b - a)) for a, b in zip(offsets[:-1], offsets[1:])]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale (at least 1)."""
    return max_diff(got, want) / max(1.0, want.abs().max().item())


def test_a_document_starts_after_each_end_of_text_token():
    tokens = torch.tensor([[5, EOT, 7, 8, EOT, EOT, 9], [EOT, 3, 4, 5, 6, 7, EOT]])
    assert document_starts(tokens, EOT).tolist() == [[False, False, True, False, False, True, True],
                                                     [False, True, False, False, False, False, False]]
    # The end-of-text token belongs to the document it ends: it sees that document, not the next.
    mask = same_document_causal_mask(document_starts(tokens, EOT))[0, 0]
    assert mask[4].tolist() == [False, False, True, True, True, False, False]
    assert mask[5].tolist() == [False, False, False, False, False, True, False]
    assert same_document_window(document_starts(tokens, EOT), 3)[0, 3].tolist() == [False, True, True]
    assert varlen_offsets(document_starts(tokens, EOT)).tolist() == [0, 2, 5, 6, 7, 8, 14]


# ---- the KDA kernels -------------------------------------------------------------------------------

def kda_inputs(T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.empty(H, 1, dtype=torch.float64).uniform_(0.1, 2, generator=gen) * \
        F.softplus(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) - 2)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


# Chunks of 16 over 50 tokens: starts on a chunk's first and last token, one-token documents, a start at
# token 0 (drops the initial state), at the last token, and a row without any.
RESETS = {
    "boundaries": starts_at(50, [5, 16, 17, 31, 32, 48], [0, 15, 40, 49]),
    "one_row_without": starts_at(50, [], [1, 2, 3, 33]),
}


@pytest.mark.parametrize("case", RESETS)
def test_kda_chunked_with_resets_matches_recurrent_with_resets(case):
    resets = RESETS[case]
    inputs = kda_inputs(50)
    state0 = torch.randn(B, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    grad_o = torch.randn(B, 50, H, V, generator=gen, dtype=torch.float64)
    grad_s = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def run(kernel, **kwargs):
        leaves = [t.clone().requires_grad_() for t in (*inputs, state0)]
        o, s = kernel(*leaves[:5], 0.4, initial_state=leaves[5], output_final_state=True, resets=resets, **kwargs)
        torch.autograd.backward([o, s], [grad_o, grad_s])
        return [o, s, *(leaf.grad for leaf in leaves)]

    chunked, recurrent = run(kda_chunk, chunk_size=16), run(kda_recurrent)
    for name, got, want in zip("o state dq dk dv dg dbeta dstate0".split(), chunked, recurrent):
        assert relative_diff(got, want) < TOL, name
    unmasked, _ = kda_recurrent(*inputs, 0.4, state0)
    assert max_diff(unmasked, recurrent[0]) > LEAK  # negative control: the resets change the result


def test_kda_chunked_with_resets_matches_each_document_alone():
    resets = RESETS["boundaries"]
    inputs = kda_inputs(50, seed=3)
    packed, _ = kda_chunk(*inputs, 0.4, 16, resets=resets)
    for row, begin, end in segments(resets):
        alone, _ = kda_chunk(*(t[row:row + 1, begin:end] for t in inputs), 0.4, 16)
        assert max_diff(packed[row:row + 1, begin:end], alone) < TOL, (row, begin, end)
    unmasked, _ = kda_chunk(*inputs, 0.4, 16)
    assert max_diff(unmasked, packed) > LEAK


# ---- the layers ------------------------------------------------------------------------------------

def layer_cfg() -> ModelConfig:
    # init_std large enough that outputs are O(0.1-1), so differences mean something.
    return ModelConfig(d_model=32, n_heads=2, init="flat", init_std=0.2, kda=KDAConfig(head_dim=8, chunk_size=16),
                       mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6))


def make_layer(cls):
    cfg = layer_cfg()
    layer = cls(cfg)
    initialise(layer, cfg.init_stds, seed=0)
    return layer.double()


LAYER_STARTS = starts_at(45, [7, 8, 16, 30], [20])


@pytest.mark.parametrize("cls, tolerance", [(KimiDeltaAttention, REL_KDA), (MultiHeadLatentAttention, TOL)])
@torch.no_grad()
def test_token_mixer_with_documents_matches_each_document_alone(cls, tolerance):
    layer = make_layer(cls)
    x = torch.randn(2, 45, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    packed = layer(x, document_starts=LAYER_STARTS)
    for row, begin, end in segments(LAYER_STARTS):
        alone = layer(x[row:row + 1, begin:end])
        assert relative_diff(packed[row:row + 1, begin:end], alone) < tolerance, (row, begin, end)
    assert relative_diff(layer(x), packed) > LEAK


def test_short_conv_does_not_reach_across_a_boundary():
    conv = make_layer(KimiDeltaAttention).q_conv1d  # width 4, so 3 tokens of each new document could leak
    x = torch.randn(1, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    starts = starts_at(12, [5])
    tail = x.new_zeros(1, 3, 16)
    window = same_document_window(starts, 4)
    packed, _ = _short_conv(conv, x, tail, window)
    alone, _ = _short_conv(conv, x[:, 5:], tail)
    assert max_diff(packed[:, 5:], alone) < TOL
    changed = x.clone()
    changed[:, :5] = torch.randn(1, 5, 16, dtype=torch.float64)
    assert torch.equal(_short_conv(conv, changed, tail, window)[0][:, 5:], packed[:, 5:])
    # One document: the masked sum is conv1d's, term by term.
    assert max_diff(_short_conv(conv, x, tail, same_document_window(starts_at(12, []), 4))[0],
                    _short_conv(conv, x, tail)[0]) < TOL
    assert max_diff(_short_conv(conv, x, tail)[0][:, 5:8], alone[:, :3]) > LEAK


# ---- the whole decoder -----------------------------------------------------------------------------

def make_decoder(variant: str):
    torch.manual_seed(0)
    # xs (3 KDA blocks, then MLA) with 16-token KDA chunks, so documents straddle chunks.
    model = build_model(load_config(["model=xs", f"variant={variant}", "model.kda.chunk_size=16"])).double()
    with torch.no_grad():  # zero-init depth queries would make every read uniform
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.copy_(torch.randn_like(p))
    return model


def document(length: int, seed: int) -> torch.Tensor:
    """A document of `length` tokens: `length - 1` tokens other than EOT, then EOT."""
    body = torch.randint(1, 512, (length - 1,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([body, torch.tensor([EOT])])


def logits_and_grads(model, earlier: list[torch.Tensor], masked: bool):
    """The packed window `earlier` + the document of interest (23 tokens) + the start of another (10);
    returns the logits from that document on and the parameter gradients of its mean loss."""
    focus, after = document(23, seed=10), document(10, seed=11)
    tokens = torch.cat([*earlier, focus, after]).unsqueeze(0)  # (1, T)
    offset = sum(len(d) for d in earlier)
    logits = model(tokens, document_starts=document_starts(tokens, EOT) if masked else None)
    span = slice(offset, offset + len(focus) - 1)  # the focus document predicting its own next tokens
    F.cross_entropy(logits[0, span], tokens[0, offset + 1:offset + len(focus)]).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits[0, offset:].detach(), grads


@pytest.mark.parametrize("variant", ["baseline", "block"])
def test_an_earlier_document_changes_no_logit_or_gradient_of_a_later_one(variant):
    model = make_decoder(variant)
    reference = logits_and_grads(model, [document(14, seed=1), document(9, seed=2)], masked=True)
    alternatives = {"changed": [document(14, seed=3), document(9, seed=4)],
                    "longer": [document(31, seed=5)],
                    "removed": []}
    for name, earlier in alternatives.items():
        logits, grads = logits_and_grads(model, earlier, masked=True)
        assert relative_diff(logits, reference[0]) < REL_KDA, name
        assert grads.keys() == reference[1].keys()
        for param, grad in grads.items():
            assert relative_diff(grad, reference[1][param]) < REL_KDA, (name, param)
    # Negative control: without masking the same change reaches the later document.
    logits, grads = logits_and_grads(model, alternatives["changed"], masked=False)
    unmasked_reference = logits_and_grads(model, [document(14, seed=1), document(9, seed=2)], masked=False)
    assert relative_diff(logits, unmasked_reference[0]) > LEAK
    assert max(relative_diff(grads[p], unmasked_reference[1][p]) for p in grads) > LEAK


def test_masking_off_is_todays_forward():
    model = make_decoder("block")
    tokens = torch.cat([document(30, seed=1), document(20, seed=2)]).unsqueeze(0)
    off = model(tokens)
    assert torch.equal(model(tokens, document_starts=None), off)
    # One document per row: the masked path computes the same thing through other ops.
    one_document = torch.zeros_like(tokens, dtype=torch.bool)
    assert relative_diff(model(tokens, document_starts=one_document), off) < REL_KDA


def test_document_masking_refuses_a_decoding_cache_and_a_wrong_shape():
    model = make_decoder("baseline")
    tokens = document(12, seed=1).unsqueeze(0)
    cache = model.new_inference_cache(1, "cpu", torch.float64)
    with pytest.raises(ValueError, match="Decoder.forward: document_starts was given with a decoding cache"):
        model(tokens, cache=cache, document_starts=document_starts(tokens, EOT))
    with pytest.raises(ValueError, match=r"KimiDeltaAttention: document_starts must be a bool tensor .* \(1, 12\); "
                                         r"got torch.int64 of shape \(1, 11\)"):
        model(tokens, document_starts=torch.zeros(1, 11, dtype=torch.long))
