"""Prefill and decode with caches: greedy, temperature and top-p sampling.

Depth attention mixes sources within one token, so decoding keeps no block representations of past
tokens: the KDA recurrent state and the MLA compressed KV are the whole cache. During prefill every
token of a chunk holds its blocks; `prefill_chunk` bounds that memory.

`compile=True` runs the one-token decode step through torch.compile (prefill stays eager: its length
varies). The MLA cache grows by a token per step, so the first steps recompile until dynamo marks the
cache length dynamic (automatic dynamic shapes); from then on every step reuses one set of graphs.
"""
from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, cache, chunk: int | None = None) -> torch.Tensor:
    """Run the prompt (B, T) through the model in chunks, filling `cache`; returns the last chunk's logits."""
    chunk = chunk or tokens.shape[1]
    logits = None
    for start in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, start:start + chunk], cache=cache)
    return logits


def decode_step(model, compile: bool = False):
    """The call that continues a sequence by one token: (B, 1) tokens, cache -> (B, 1, vocab) logits."""
    return torch.compile(model) if compile else model


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             prefill_chunk: int | None = None, seed: int | None = None, stop_token: int | None = None,
             compile: bool = False) -> torch.Tensor:
    """prompt (B, T0) -> (B, T0 + generated). Stops early when every row produced `stop_token`.
    compile: run the decode step through torch.compile (see the module docstring)."""
    if prompt.shape[1] == 0:
        raise ValueError("the prompt is empty; give at least one token")
    model.eval()
    weight = next(model.parameters())
    cache = model.new_inference_cache(prompt.shape[0], weight.device, weight.dtype)
    generator = torch.Generator(device=prompt.device).manual_seed(seed) if seed is not None else None
    logits = prefill(model, prompt, cache, prefill_chunk)
    step = decode_step(model, compile)
    return _sampled(prompt, logits, lambda token, _: step(token.unsqueeze(1), cache=cache), max_new_tokens,
                    temperature, top_p, generator, stop_token)


@torch.no_grad()
def generate_uncached(logits_of, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, stop_token: int | None = None) -> torch.Tensor:
    """As `generate`, through a forward that keeps no cache, `logits_of` (B, T) -> (B, T, vocab) (a distributed
    layout's collective forward): each token comes from a forward over the whole sequence so far."""
    return _sampled(prompt, logits_of(prompt), lambda _, out: logits_of(out), max_new_tokens, temperature, top_p,
                    None, stop_token)


def _sampled(prompt: torch.Tensor, logits: torch.Tensor, advance, max_new_tokens: int, temperature: float,
             top_p: float, generator: torch.Generator | None, stop_token: int | None) -> torch.Tensor:
    """prompt (B, T0) continued from the prompt's `logits`; `advance(token (B,), out (B, T))` gives the logits
    after the newest token."""
    out = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        token = sample_next(logits[:, -1], temperature, top_p, generator)
        out = torch.cat([out, token.unsqueeze(1)], dim=1)
        if stop_token is not None:
            done |= token == stop_token
            if done.all():
                break
        logits = advance(token, out)
    return out
