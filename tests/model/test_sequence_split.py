"""Token mixers on a sequence split into slices (model/sequence_split.py), the slices run one after another
in this process: outputs and every gradient equal one pass over the whole sequence, and dropping what a
slice receives from the earlier ones breaks that. parallel/context.py does the same across processes."""
import pytest
import torch

from model.config import KDAConfig, MLAConfig, ModelConfig
from model.init import initialise
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention

T, D = 48, 32


class InOrderSplit:
    """A SequenceSplit for slices run in order in one process, with autograd across them. pass_state=False
    starts every slice's recurrence from zero and pass_past=False shows MLA only its own slice: the
    negative controls."""

    def __init__(self, pass_state: bool = True, pass_past: bool = True):
        self.pass_state, self.pass_past = pass_state, pass_past
        self.previous, self.history, self.carried = None, [], None

    def previous_rows(self, x, n):
        rows = x.new_zeros(x.shape[0], n, x.shape[2]) if self.previous is None else self.previous[:, -n:]
        self.previous = x
        return rows

    def through_mine(self, x):
        self.history.append(x)
        return torch.cat(self.history if self.pass_past else [x], dim=1)

    def start_state(self, final, transition):
        start = torch.zeros_like(final) if self.carried is None or not self.pass_state else self.carried
        self.carried = transition @ (torch.zeros_like(final) if self.carried is None else self.carried) + final
        return start


def kda() -> KimiDeltaAttention:
    cfg = ModelConfig(d_model=D, n_heads=2, init="flat", init_std=0.2, kda=KDAConfig(head_dim=8, chunk_size=16))
    layer = KimiDeltaAttention(cfg)
    initialise(layer, cfg.init_stds, seed=0)
    return layer


def mla() -> MultiHeadLatentAttention:
    cfg = ModelConfig(d_model=D, n_heads=4, init="flat", init_std=0.2,
                      mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6))
    layer = MultiHeadLatentAttention(cfg)
    initialise(layer, cfg.init_stds, seed=0)
    return layer


def run(layer, x, grad_out, slices: int, split=None):
    """Output and gradients (input's, then every parameter's) of the layer over x cut into `slices`."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    layer.sequence_split = split
    out = torch.cat([layer(piece) for piece in x.chunk(slices, dim=1)], dim=1)  # (B, T, D)
    layer.sequence_split = None
    out.backward(grad_out)
    return out.detach(), {"input": x.grad, **{name: p.grad.clone() for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("make_layer", [kda, mla], ids=["kda", "mla"])
@pytest.mark.parametrize("slices", [2, 4])
def test_slices_in_order_equal_the_whole_sequence(make_layer, slices):
    torch.manual_seed(0)
    layer = make_layer()
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(2, T, D, generator=torch.Generator().manual_seed(2))
    out_whole, grads_whole = run(layer, x, grad_out, 1)
    out_split, grads_split = run(layer, x, grad_out, slices, InOrderSplit())
    assert out_whole.abs().max() > 0.05
    torch.testing.assert_close(out_split, out_whole, atol=2e-6, rtol=1e-5)
    for name, want in grads_whole.items():
        torch.testing.assert_close(grads_split[name], want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=0,
                                   msg=name)

    control = InOrderSplit(pass_state=False) if make_layer is kda else InOrderSplit(pass_past=False)
    out_control, _ = run(layer, x, grad_out, slices, control)
    assert (out_control - out_whole).abs().max() > 1e-2


def test_a_split_refuses_document_starts_and_decoding_state():
    layer, x = kda(), torch.randn(1, 8, D)
    layer.sequence_split = InOrderSplit()
    with pytest.raises(ValueError, match="sequence_split"):
        layer(x, document_starts=torch.zeros(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="sequence_split"):
        layer(x, layer.new_state(1))
