"""Token mixers on a sequence split into slices (model/sequence_split.py), the slices run one after another
in this process: outputs and every gradient equal one pass over the whole sequence, with and without
document masking, and dropping what a slice receives from the earlier ones breaks that. parallel/context.py
does the same across processes."""
import pytest
import torch

from model.config import KDAConfig, MLAConfig, ModelConfig
from model.init import initialise
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention

T, D = 48, 32


class InOrderSplit:
    """A SequenceSplit for slices run in order in one process, with autograd across them: the n-th exchange of
    a slice (previous_rows or through) sees the n-th of the slices before. `next_slice` starts the next slice.
    Each slice scores its own queries (no balancing: later slices do not exist yet). pass_state=False starts
    every slice's recurrence from zero and pass_past=False gives MLA zeros for the earlier slices' latents:
    the negative controls."""

    def __init__(self, pass_state: bool = True, pass_past: bool = True):
        self.pass_state, self.pass_past = pass_state, pass_past
        self.slices, self.carried = [], None  # slices: per slice, what each exchange sent

    def next_slice(self):
        self.slices.append([])

    def _exchange(self, x):
        """(the same exchange's x of every earlier slice, in order)"""
        earlier = [sent[len(self.slices[-1])] for sent in self.slices[:-1]]
        self.slices[-1].append(x)
        return earlier

    def previous_rows(self, x, n):
        earlier = self._exchange(x)
        return x.new_zeros(x.shape[0], n, x.shape[2]) if not earlier else earlier[-1][:, -n:]

    def through(self, x, end):
        earlier = [e if self.pass_past else torch.zeros_like(e) for e in self._exchange(x)]
        return torch.cat([*earlier, x], dim=1)[:, :end]

    def scored_pieces(self, length):
        return [((len(self.slices) - 1) * length, length)]

    def balance(self, x):
        return x

    def unbalance(self, x):
        return x

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


def run(layer, x, grad_out, slices: int, split=None, starts=None):
    """Output and gradients (input's, then every parameter's) of the layer over x cut into `slices`, with
    document starts (B, T) or none."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    layer.sequence_split = split
    outputs = []
    for index, piece in enumerate(x.chunk(slices, dim=1)):
        if split is not None:
            split.next_slice()
        piece_starts = None if starts is None else starts.chunk(slices, dim=1)[index]
        outputs.append(layer(piece, document_starts=piece_starts))
    layer.sequence_split = None
    out = torch.cat(outputs, dim=1)  # (B, T, D)
    out.backward(grad_out)
    return out.detach(), {"input": x.grad, **{name: p.grad.clone() for name, p in layer.named_parameters()}}


def document_starts_at(*positions) -> torch.Tensor:
    """(2, T) bool: row 0 starts documents at `positions`, row 1 at none."""
    starts = torch.zeros(2, T, dtype=torch.bool)
    starts[0, list(positions)] = True
    return starts


# Documents starting inside a slice, at a slice's first token (24 with 2 slices, 12 with 4) and within the
# convolution's reach of a slice boundary (13, 25: the next slice's window spans them).
STARTS = {"no documents": None, "documents": document_starts_at(5, 13, 24, 25, 40)}


@pytest.mark.parametrize("starts", STARTS.values(), ids=STARTS.keys())
@pytest.mark.parametrize("make_layer", [kda, mla], ids=["kda", "mla"])
@pytest.mark.parametrize("slices", [2, 4])
def test_slices_in_order_equal_the_whole_sequence(make_layer, slices, starts):
    torch.manual_seed(0)
    layer = make_layer()
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(2, T, D, generator=torch.Generator().manual_seed(2))
    out_whole, grads_whole = run(layer, x, grad_out, 1, starts=starts)
    out_split, grads_split = run(layer, x, grad_out, slices, InOrderSplit(), starts)
    assert out_whole.abs().max() > 0.05
    torch.testing.assert_close(out_split, out_whole, atol=2e-6, rtol=1e-5)
    for name, want in grads_whole.items():
        torch.testing.assert_close(grads_split[name], want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=0,
                                   msg=name)

    control = InOrderSplit(pass_state=False) if make_layer is kda else InOrderSplit(pass_past=False)
    out_control, _ = run(layer, x, grad_out, slices, control, starts)
    assert (out_control - out_whole).abs().max() > 1e-2


def test_a_split_refuses_a_decoding_cache():
    layer, x = kda(), torch.randn(1, 8, D)
    layer.sequence_split = InOrderSplit()
    with pytest.raises(ValueError, match="sequence_split"):
        layer(x, layer.new_cache(1))
