"""The ReSkip hook, `model(tokens, skip=...)`: a skipped sublayer does not run, and the residual state sees
its absence. Checked against forwards written out by hand (baseline: the running sum without it; Block
AttnRes: its block's partial sum without it, a block whose sublayers are all skipped absent from the
sources), against its module never being called, and against cached decoding with the same skips."""
import pytest
import torch
import torch.nn.functional as F

from model import build_model
from trainer.config import load_config


def make_model(variant: list[str]):
    torch.manual_seed(0)
    model = build_model(load_config(["model=xs", *variant])).eval()
    with torch.no_grad():  # trained-looking queries: a zero query would make every read uniform
        for name, param in model.named_parameters():
            if name.endswith(".query"):
                param.normal_(std=0.1)
            if name.endswith("key_norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def sublayers(model):
    """(read params, norm, function) of sublayers 1..L in order."""
    out = []
    for block in model.layers.values():
        out.append((block.attn_res, block.attn_norm, lambda x, b=block: b.attn(x, None)))
        out.append((block.mlp_res, block.mlp_norm, block.mlp))
    return out


def hand_baseline(model, tokens, skip):
    h = model.embed(tokens)
    for l, (_, norm, f) in enumerate(sublayers(model), 1):
        if l not in skip:
            h = h + f(norm(h))
    return model.lm_head(model.norm(h))


def hand_read(sources, read, eps):
    """Softmax over sources of (query * key-norm gain) . rmsnorm(source); one head."""
    query = read.query * read.key_norm.weight
    scores = torch.stack([F.rms_norm(s, (s.shape[-1],), eps=eps) @ query for s in sources])
    weights = torch.softmax(scores, 0)
    return sum(w.unsqueeze(-1) * s for w, s in zip(weights, sources))


def hand_block(model, tokens, skip, block_size):
    eps = model.cfg.norm_eps
    blocks, partial = [model.embed(tokens)], None
    for l, (read, norm, f) in enumerate(sublayers(model), 1):
        position = (l - 1) % block_size
        if l not in skip:
            v = f(norm(hand_read(blocks + ([partial] if partial is not None else []), read, eps)))
            partial = v if partial is None else partial + v
        if position == block_size - 1 and partial is not None:
            blocks.append(partial)
            partial = None
    final = hand_read(blocks + ([partial] if partial is not None else []), model.final_res, eps)
    return model.lm_head(model.norm(final))


TOKENS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("skip", [frozenset(), frozenset({3}), frozenset({8}), frozenset({2, 5, 6})])
def test_baseline_skip_equals_the_running_sum_without_those_sublayers(skip):
    model = make_model(["variant=baseline"])
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS, skip=skip), hand_baseline(model, TOKENS, skip), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("two_phase", ["true", "false"])
@pytest.mark.parametrize("skip", [frozenset(), frozenset({3}), frozenset({4}), frozenset({3, 4}), frozenset({1, 2, 8})])
def test_block_skip_equals_the_block_sums_without_those_sublayers(skip, two_phase):
    model = make_model(["variant=block", "variant.block_size=2", f"variant.two_phase={two_phase}"])
    with torch.no_grad():
        expected = hand_block(model, TOKENS, skip, 2)
        torch.testing.assert_close(model(TOKENS, skip=skip), expected, rtol=1e-5, atol=1e-5)
        if skip:  # the check has teeth: skipping changes the output
            assert not torch.allclose(expected, hand_block(model, TOKENS, frozenset(), 2), atol=1e-3)


@pytest.mark.parametrize("variant", [["variant=baseline"], ["variant=block", "variant.block_size=4"], ["variant=full"]])
def test_a_skipped_sublayers_modules_are_never_called(variant):
    model = make_model(variant)
    called = []
    block = model.layers["1"]  # sublayers 3 (attention) and 4 (MLP)
    for name, module in [("attn_norm", block.attn_norm), ("attn", block.attn), ("mlp", block.mlp)]:
        module.register_forward_hook(lambda *_, name=name: called.append(name))
    with torch.no_grad():
        model(TOKENS, skip=frozenset({3}))
    assert called == ["mlp"]
    called.clear()
    with torch.no_grad():
        model(TOKENS, skip=frozenset({3, 4}))
    assert called == []


@pytest.mark.parametrize("variant", [["variant=baseline"], ["variant=block", "variant.block_size=4"]])
def test_cached_decoding_with_skips_matches_the_full_sequence_forward(variant):
    model = make_model(variant)
    skip = frozenset({3, 8})
    with torch.no_grad():
        full = model(TOKENS, skip=skip)
        cache = model.new_inference_cache(TOKENS.shape[0], torch.device("cpu"), torch.float32)
        steps = [model(TOKENS[:, t:t + 1], cache=cache, skip=skip) for t in range(TOKENS.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_a_skipped_sublayers_query_is_not_scored_in_its_blocks_batched_read():
    """Block two-phase: phase 1 batches the queries of a block's sublayers; a skipped one's is left out, so
    no phase-1 result is computed for it (and none is left behind)."""
    model = make_model(["variant=block", "variant.block_size=4"])
    state = model.mixer.start(model.embed(torch.zeros(1, 3, dtype=torch.long)))
    state.skipped = {2, 6, 7}
    with torch.no_grad():
        state = model.forward_layers(state)
    assert state.phase1 == {}
