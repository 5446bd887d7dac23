"""Every RNG's state as JSON values, for checkpoints (which hold no pickles) and for putting the RNGs back
after an evaluation inside training."""
from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _bytes_to_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG's state as JSON values; set_rng_state restores it exactly. torch's states are byte tensors
    (base64 here); numpy's and Python's are tuples of ints and a float."""
    bit_generator, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": _bytes_to_text(torch.get_rng_state()),
             "numpy": {"bit_generator": bit_generator, "key": key.tolist(), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["bit_generator"], np.array(numpy["key"], dtype=np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in state["cuda"]])
