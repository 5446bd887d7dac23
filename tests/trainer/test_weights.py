"""trainer/weights.py's finiteness check on weights stored in float8, which torch.isfinite has no kernel for:
a float8 export loads (for generation and for init_from) as its values widened to float32, a NaN among them
is refused like one in float32, and a packed float4 tensor, which nothing widens, is refused in one line."""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model import build_model
from trainer.config import load_config
from trainer.run_dir.checkpoint import CheckpointError
from trainer.retrofit import init_from
from inference.export import ExportError
from inference.generate import load_exported_model
from inference.hf.write_export import write_hf_export

FLOAT8 = torch.float8_e4m3fn


def float8_state(model) -> dict[str, torch.Tensor]:
    """`model`'s state with every matrix in float8_e4m3fn (vectors such as norm gains kept as they are)."""
    return {name: tensor.to(FLOAT8) if tensor.dim() == 2 else tensor.clone()
            for name, tensor in model.state_dict().items()}


def widened(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.float() for name, tensor in state.items()}


def test_a_native_export_in_float8_loads_as_its_values_widened(tmp_path):
    cfg = load_config(["model=xs"])
    state = float8_state(build_model(cfg, seed=3))
    assert sum(tensor.dtype == FLOAT8 for tensor in state.values()) > 10
    save_file(state, tmp_path / "model.safetensors")
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:  # a real float8 file, not a cast on reading
        assert weights.get_tensor(next(name for name, t in state.items() if t.dtype == FLOAT8)).dtype == FLOAT8
    loaded = load_exported_model(tmp_path, cfg).state_dict()
    for name, tensor in widened(state).items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor), name


def test_a_nan_in_a_float8_export_is_refused_naming_the_tensor(tmp_path):
    cfg = load_config(["model=xs"])
    state = float8_state(build_model(cfg, seed=3))
    name = next(name for name, tensor in state.items() if tensor.dtype == FLOAT8)
    poisoned = state[name].float()
    poisoned[0, :3] = float("nan")
    state[name] = poisoned.to(FLOAT8)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ExportError) as error:
        load_exported_model(tmp_path, cfg)
    assert str(error.value) == (f"{tmp_path / 'model.safetensors'}: tensor {name} holds 3 non-finite values (NaN or "
                                f"inf) of {state[name].numel():,}; export a checkpoint whose weights are finite")


def hf_export_with(state: dict[str, torch.Tensor], model, out: Path) -> Path:
    """A format=hf export of `model`, its weights file then rewritten to hold `state` (same names, same header)."""
    out.mkdir()
    write_hf_export(out, model.cfg, model.state_dict(), 32, 0, out / "no-tokenizer.json", copy=None,
                    max_shard_size="5GB")
    file = out / "model.safetensors"
    with safe_open(file, "pt") as weights:
        metadata = weights.metadata()
    written = load_file(file)
    assert written.keys() == {f"model.{name}" for name in state}
    save_file({f"model.{name}": tensor for name, tensor in state.items()}, file, metadata=metadata)
    return out


def test_init_from_a_float8_hf_export_copies_its_values_widened(tmp_path):
    source = build_model(load_config(["model=xs"]).model, seed=3)
    state = float8_state(source)
    hf_dir = hf_export_with(state, source, tmp_path / "hf")
    fresh = build_model(source.cfg, seed=9)
    assert init_from(fresh, str(hf_dir)) == hf_dir
    for name, tensor in widened(state).items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_init_from_refuses_packed_float4_weights_in_one_line(tmp_path):
    source = build_model(load_config(["model=xs"]).model, seed=3)
    state = float8_state(source)
    name = next(name for name, tensor in state.items() if tensor.dtype == FLOAT8)
    state[name] = torch.zeros(state[name].numel() // 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    hf_dir = hf_export_with(state, source, tmp_path / "hf")
    with pytest.raises(CheckpointError) as error:
        init_from(build_model(source.cfg, seed=9), str(hf_dir))
    assert str(error.value) == (f"init_from={hf_dir}: {hf_dir}: tensor {name} is float4_e2m1fn_x2, which cannot be "
                                "widened into the model's parameters; store the weights as float32, bfloat16, "
                                "float16 or a float8 dtype")
