"""Our model inside lm-evaluation-harness: `AttnResLM`, over a model in memory (`AttnResLM(model, tokenizer,
seq_len)`: the trainer's live model for train.eval_tasks). inference/exported_lm.py builds it from an export
directory and registers it as lm_eval's model "attnres"; `python -m inference.evaluate` is the command line.

Scoring is exact under batching: the model is causal, and nothing in it (depth attention, MoE routing, norms,
MLA without positional encoding, KDA) mixes a token with a later one, so right-padding a batch leaves every
real token's logits as they are alone. Inputs longer than the context (max_length, the trained
train.seq_len by default) keep their last tokens; each call says once how many requests that cut.
"""
from __future__ import annotations

import sys

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
# Importing lm_eval.models (for its utils) registers lm_eval's own models, which it does by itself only while its
# registry is empty: after inference.exported_lm registers "attnres", "hf" and the rest would be unknown otherwise.
from lm_eval.models.utils import Collator, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from model.generation import generate, generate_uncached
from trainer.data.format import EOT_TOKEN

# lm_eval's own default for a generation task that names no max_gen_toks.
DEFAULT_MAX_GEN_TOKS = 256
# What generate_until can honour: stop strings, a token budget, greedy decoding or temperature/top-p sampling
# (normalize_gen_kwargs turns max_new_tokens and the other aliases into max_gen_toks).
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")


class LMEvalError(ValueError):
    """Bad input to the attnres LM or to the tasks it runs; the message is one line."""


def pick_device(device: str | torch.device | None) -> torch.device:
    """auto (or None): cuda when there is one, else cpu."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError:
        raise LMEvalError(f"device={device} is not a torch device; give auto, cpu, cuda or cuda:N") from None
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise LMEvalError(f"device={device} but torch sees no CUDA device here; give device=cpu or auto")
    return picked


def positive_int(name: str, value) -> int:
    """lm_eval's model_args arrive as strings or numbers; anything but a positive integer is refused."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise LMEvalError(f"{name}={value} must be a positive integer")
    return number


def longest_first(request) -> tuple:
    """Sort key of a (key, context, continuation) request: the longest first, so the first batch is the
    widest and an out-of-memory error comes at once; equal lengths by their tokens, for a fixed order."""
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def warn_truncated(count: int, total: int, kind: str, context: int) -> None:
    if count:
        print(f"warning: {count} of {total} {kind} requests were longer than the context of {context} tokens; "
              "their first tokens were cut", file=sys.stderr)


class AttnResLM(TemplateLM):
    def __init__(self, model, tokenizer, seq_len: int, batch_size: int = 8, max_length: int | None = None,
                 device: str | None = None):
        """`model` a Decoder (put in eval mode), or a forward that keeps no cache (trainer/downstream.py's
        LayoutForward: (B, T) ids -> (B, T, vocab) logits, with a `device`), whose generation recomputes the
        sequence each token; `tokenizer` a tokenizers.Tokenizer, `seq_len` the context the model was trained at;
        max_length (<= seq_len) bounds every input. device None keeps the model where it is."""
        super().__init__()
        self._batch_size = positive_int("batch_size", batch_size)
        self._max_length = seq_len if max_length is None else positive_int("max_length", max_length)
        if self._max_length > seq_len:
            raise LMEvalError(f"max_length={max_length} is beyond the trained context of {seq_len} tokens "
                                f"(train.seq_len); give at most {seq_len}")
        eot = tokenizer.token_to_id(EOT_TOKEN)
        if eot is None:
            raise LMEvalError(f"the tokenizer has no {EOT_TOKEN} token, which ends every training document; "
                                "give the tokenizer the model was trained with")
        self._eot_token_id = eot
        self.tokenizer = tokenizer
        if isinstance(model, torch.nn.Module):
            self._device = next(model.parameters()).device if device is None else pick_device(device)
            self.model = model.to(self._device).eval()
        else:
            self._device, self.model = model.device, model

    @property
    def eot_token_id(self) -> int:
        return self._eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Training documents were encoded without special tokens (trainer/data/prepare.py); the tokenizer
        # adds none of its own, whatever lm_eval asks.
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """requests: (key, context tokens, continuation tokens) -> (log P(continuation | context), whether
        greedy decoding would produce the continuation), longest first in batches of batch_size."""
        for _, _, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored within the "
                                 f"context of {self.max_length} tokens (it must be 1 to {self.max_length})")
        order = Collator(requests, sort_fn=longest_first)
        results, truncated = [], 0
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for batch in order.get_batched(n=self.batch_size):
            truncated += sum(len(context) + len(continuation) > self.max_length + 1
                             for _, context, continuation in batch)
            results.extend(self._score_batch([context + continuation for _, context, continuation in batch],
                                             [continuation for _, _, continuation in batch]))
            progress.update(len(batch))
        progress.close()
        warn_truncated(truncated, len(requests), "loglikelihood", self.max_length)
        return order.get_original(results)

    def _score_batch(self, sequences: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """One forward over the right-padded batch; each row's last len(continuation) predictions scored."""
        # The last token of a sequence is only predicted, never an input; a longer one keeps its last tokens.
        inputs = [sequence[-(self.max_length + 1):][:-1] for sequence in sequences]
        width = max(len(row) for row in inputs)
        padded = torch.tensor([row + [self.eot_token_id] * (width - len(row)) for row in inputs],
                              device=self.device)  # (B, T)
        logits = self.model(padded)  # (B, T, vocab)
        scores = []
        for row, inputs_row, continuation in zip(logits, inputs, continuations):
            end = len(inputs_row)
            log_probs = torch.log_softmax(row[end - len(continuation):end].float(), dim=-1)  # (C, vocab)
            targets = torch.tensor(continuation, device=self.device)  # (C,)
            picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (C,)
            scores.append((float(picked.sum()), bool((log_probs.argmax(-1) == targets).all())))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log P(text) of each request's text, after the end-of-text token: disjoint windows of max_length
        predictions, each conditioned on the tokens before it (lm_eval's rolling windows, as its HF adapter)."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += log_prob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request (context, generation kwargs) continued by model.generation.generate with the
        inference cache, one at a time, greedy unless do_sample; the text is cut at the first stop string."""
        outputs, truncated = [], 0
        for context, gen_kwargs in tqdm([request.args for request in requests], disable=disable_tqdm,
                                        desc="Running generate_until requests"):
            kwargs = self._generation_kwargs(gen_kwargs)
            prompt, was_cut = self._generation_prompt(context, kwargs["max_gen_toks"])
            truncated += was_cut
            outputs.append(self._generate_one(prompt, kwargs))
        warn_truncated(truncated, len(requests), "generate_until", self.max_length)
        return outputs

    def _generation_kwargs(self, gen_kwargs: dict) -> dict:
        """A task's generation kwargs, normalised by lm_eval (until a list, max_gen_toks, do_sample, temperature)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        unsupported = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unsupported:
            raise ValueError(f"generation kwargs {', '.join(unsupported)} are not supported by the attnres model; "
                             f"it honours {', '.join(GENERATION_KEYS)}")
        if not 0 < kwargs["max_gen_toks"] < self.max_length:
            raise ValueError(f"max_gen_toks={kwargs['max_gen_toks']} must be in [1, {self.max_length - 1}]: the "
                             f"prompt and the generated tokens share the context of {self.max_length} tokens")
        return kwargs

    def _generation_prompt(self, context: str, max_gen_toks: int) -> tuple[list[int], bool]:
        """The prompt's last tokens that leave room for max_gen_toks (an empty prompt is the end-of-text token,
        what precedes every training document), and whether any were cut."""
        room = self.max_length - max_gen_toks
        ids = self.tok_encode(context) or [self.prefix_token_id]
        return ids[-room:], len(ids) > room

    @torch.no_grad()
    def _generate_one(self, prompt: list[int], kwargs: dict) -> str:
        temperature = kwargs["temperature"] if kwargs["do_sample"] else 0.0
        # generate stops at the end-of-text token itself; stop strings can end inside a token, so they cut the text.
        ids = torch.tensor([prompt], device=self.device)  # (1, T0)
        sampling = {"temperature": temperature, "top_p": float(kwargs.get("top_p", 1.0)),
                    "stop_token": self.eot_token_id}
        cached = isinstance(self.model, torch.nn.Module)
        tokens = (generate if cached else generate_uncached)(self.model, ids, kwargs["max_gen_toks"], **sampling)
        return postprocess_generated_text(self.tok_decode(tokens[0, len(prompt):].tolist()), kwargs["until"], None)
