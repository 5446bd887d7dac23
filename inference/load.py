"""`load_model(DIR)`: a model and its tokenizer from a released Kimi checkpoint directory (Kimi Linear or K3, as
published) or from one of our exports (inference.export format=native). The model is our Decoder, fp32 on the
CPU in eval mode: model(ids) -> logits (B, T, V); the tokenizer a tokenizers.Tokenizer.

    from inference import load_model
    model, tokenizer = load_model("Kimi-Linear-48B-A3B-Instruct")
    logits = model(torch.tensor([tokenizer.encode("Hello").ids]))
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from inference.generate import open_model_dir


def load_model(directory: str | Path) -> tuple[nn.Module, object | None]:
    """(model, tokenizer) of a release directory or one of our exports (the tokenizer None: a release that ships
    none)."""
    source = open_model_dir("directory", str(directory), None, None, need_tokenizer=False)
    return source.load(), source.tokenizer
