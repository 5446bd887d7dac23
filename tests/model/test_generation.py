"""Inference: incremental decoding and chunked prefill equal the full forward; sampling rules."""
import pytest
import torch

from model import build_model
from model.generation import generate, generate_uncached, prefill, sample_next
from trainer.config import load_config


def make(variant, *overrides):
    """fp32: KDA and the MoE router compute in fp32 whatever the dtype, so fp64 would not be tighter."""
    torch.manual_seed(0)
    model = build_model(load_config(["model=xs", f"variant={variant}", *overrides])).eval()
    with torch.no_grad():  # non-zero queries, so the depth reads are not uniform
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.copy_(torch.randn_like(p))
    return model


TOKENS = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(3))


# K3's MoE options: decode steps take the gather path (a row per expert at most), the full forward the loop.
RELEASE_MOE = ["model.moe.activation=situ", "model.moe.latent_dim=48", "model.moe.latent_norm=true",
               "model.moe.n_expert_groups=2"]


@pytest.mark.parametrize("variant, overrides", [("baseline", []), ("full", []), ("block", []), ("block", RELEASE_MOE)],
                         ids=["baseline", "full", "block", "block-release_moe"])
def test_incremental_decoding_equals_the_full_forward(variant, overrides):
    model = make(variant, *overrides)
    with torch.no_grad():
        full = model(TOKENS)
        cache = model.new_inference_cache(2, torch.device("cpu"), torch.float32)
        steps = [prefill(model, TOKENS[:, :7], cache)]
        steps += [model(TOKENS[:, t:t + 1], cache=cache) for t in range(7, TOKENS.shape[1])]
    # fp32 rounding on logits of size ~4: 1e-5 to 4e-5 apart depending on the seed's weights.
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=6e-5, rtol=0)


@pytest.mark.parametrize("variant", ["full", "block"])
def test_chunked_prefill_equals_unchunked(variant):
    model = make(variant)
    whole = model.new_inference_cache(2, torch.device("cpu"), torch.float32)
    chunked = model.new_inference_cache(2, torch.device("cpu"), torch.float32)
    last_whole = prefill(model, TOKENS, whole)
    last_chunked = prefill(model, TOKENS, chunked, chunk=5)
    torch.testing.assert_close(last_chunked[:, -1], last_whole[:, -1], atol=6e-5, rtol=0)  # as above
    # The caches continue identically.
    nxt = TOKENS[:, :1]
    torch.testing.assert_close(model(nxt, cache=chunked), model(nxt, cache=whole), atol=2e-5, rtol=0)


def test_greedy_generation_continues_with_the_argmax_of_the_full_forward():
    model = make("block")
    out = generate(model, TOKENS[:, :6], max_new_tokens=4)
    assert out.shape == (2, 10)
    with torch.no_grad():
        for t in range(6, 10):
            assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_generation_without_a_cache_gives_the_cached_tokens_and_stops_at_the_stop_token():
    """generate_uncached: a distributed layout's train.eval_tasks generation (trainer/downstream.py)."""
    model = make("block")
    cached = generate(model, TOKENS[:1, :6], max_new_tokens=5)
    with torch.no_grad():
        assert torch.equal(generate_uncached(model, TOKENS[:1, :6], max_new_tokens=5), cached)
        stop = int(cached[0, 8])
        first = 6 + cached[0, 6:].tolist().index(stop)
        stopped = generate_uncached(model, TOKENS[:1, :6], max_new_tokens=5, stop_token=stop)
    assert torch.equal(stopped, cached[:, :first + 1])


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0]])
    assert sample_next(logits, 0.0, 1.0).item() == 1
    # top_p small enough keeps only the most likely token, whatever the temperature.
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 5.0, 0.1, g).item() for _ in range(50)} == {1}
    # full sampling at high temperature reaches other tokens; the same seed repeats.
    draws = [sample_next(logits, 5.0, 1.0, torch.Generator().manual_seed(s)).item() for s in range(50)]
    assert len(set(draws)) > 1
    assert draws == [sample_next(logits, 5.0, 1.0, torch.Generator().manual_seed(s)).item() for s in range(50)]


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        generate(make("baseline"), TOKENS[:, :0], max_new_tokens=2)


@pytest.mark.compile
def test_compiled_decode_generates_the_eager_tokens_with_a_bounded_number_of_compiles():
    """Two blocks (KDA, then MLA, whose cache grows every token) keep the compile short. One graph for
    the first step (the cache as prefill left it) and one for every later step (dynamo marks the growing
    length dynamic): 12 tokens must not compile 12 times."""
    # Imported here, not at the top: torch._dynamo imports triton, which must come after the kernel
    # tests (tests/kernel_device.py, imported by conftest.py) choose the interpreter.
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = build_model(load_config(["model=xs", "variant=block", "model.n_blocks=2", "model.mla_every=2"])).eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, TOKENS[:, :5], max_new_tokens=12, compile=True)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert counters["graph_break"] == {}  # the whole step is one graph: no eager islands
    assert torch.equal(compiled, generate(model, TOKENS[:, :5], max_new_tokens=12))
