"""inference.export format=hf: transformers loads the export with trust_remote_code and reproduces our logits
and greedy tokens for every residual family; the exported code is our own source, flattened, needing only
torch and transformers; the export goes back into our trainer through init_from."""
import json
import sys

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

from conftest import fast_train_overrides
from model import build_model
from model.generation import generate
from parallel.dims import init_distributed
from trainer.run_dir.checkpoint import CheckpointError
from trainer.config import load_config
from inference.export import export
from inference.generate import export_config, load_exported_model
from inference.hf.bundle import BundleError, rewrite_source, write_bundle
from inference.hf.write_export import write_hf_export
from trainer.weights import INDEX_FILE, read_hf_state
from trainer.retrofit import init_from
from trainer.trainer import Trainer

VARIANTS = ("baseline", "full", "block", "mhc", "highway", "x0")
SEQ_LEN = 32


def perturbed_model(variant: str):
    """model=xs of `variant` with every weight moved off its initialisation (zero pseudo-queries would make
    every depth read a plain average, which hides a wrong read)."""
    cfg = load_config(["model=xs", f"variant={variant}"]).model
    model = build_model(cfg, seed=3).eval()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def write_export(model, out):
    out.mkdir()
    write_hf_export(out, model.cfg, model.state_dict(), SEQ_LEN, 0, out / "no-tokenizer.json",
                    copy=None, max_shard_size="5GB")
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_reproduces_our_logits_and_greedy_tokens(variant, tmp_path):
    ours = perturbed_model(variant)
    hf = AutoModelForCausalLM.from_pretrained(write_export(ours, tmp_path / f"hf_{variant}"),
                                              trust_remote_code=True).eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(tokens, use_cache=False).logits
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 1e-5

    prompt = tokens[:, :7]
    want = generate(ours, prompt, max_new_tokens=12)
    assert torch.equal(hf.generate(prompt, max_new_tokens=12, do_sample=False), want)


def test_labels_give_the_next_token_loss(tmp_path):
    ours = perturbed_model("block")
    hf = AutoModelForCausalLM.from_pretrained(write_export(ours, tmp_path / "hf_loss"), trust_remote_code=True)
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = ours(tokens)
        expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert torch.allclose(hf(tokens, labels=tokens, use_cache=False).loss, expected, atol=1e-6)
        with pytest.raises(ValueError, match="attention_mask masks some tokens"):
            hf(tokens, attention_mask=torch.tensor([[1] * 16, [0] * 4 + [1] * 12]))


def test_the_exported_code_is_our_source_needing_only_torch_and_transformers(tmp_path):
    names = write_bundle(tmp_path)
    copied = {path.split("/")[-1] for path in get_relative_import_files(str(tmp_path / "modeling_attnres.py"))}
    assert copied | {"modeling_attnres.py"} == set(names)  # transformers copies every file the model needs
    for name in names:
        outside = {module for module in get_imports(str(tmp_path / name)) if module not in sys.stdlib_module_names}
        assert outside <= {"torch", "transformers"}, (name, outside)
    kernels = (tmp_path / "kernels_attnres.py").read_text()
    assert "from .kernels_attnres_reference import" in kernels
    assert "raise ImportError('an exported model runs plain torch: kernels.attnres.triton is not part of it')" in kernels


def test_imports_the_flattened_copy_cannot_keep_are_refused():
    text, imported = rewrite_source("from model.config import ModelConfig\n\n\ndef f():\n    import triton\n", "m.py")
    assert "from .model_config import ModelConfig" in text and imported == {"model.config"}
    assert "    raise ImportError('an exported model runs plain torch: triton is not part of it')" in text
    for source, reason in (("import triton\n", "module-level import of triton"),
                           ("from .config import X\n", "relative import"),
                           ("from kernels.attnres import reference\n", "imports a module"),
                           ("import model.config\n", "`import model.config`")):
        with pytest.raises(BundleError, match=reason):
            rewrite_source(source, "m.py")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_dataset):
    run = tmp_path_factory.mktemp("hf") / "run"
    Trainer(load_config(fast_train_overrides(run, tiny_dataset, steps=2)), init_distributed()).fit()
    return run


def test_export_of_a_run_loads_with_its_tokenizer_in_shards_and_goes_back_through_init_from(trained_run, tmp_path):
    native, hf_dir = tmp_path / "native", tmp_path / "hf"
    export(str(trained_run), str(native))
    summary = export(str(trained_run), str(hf_dir), format="hf", max_shard_size="300KB")
    assert "(format=hf)" in summary and "safetensors shards" in summary
    shards = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
    assert len(set(shards.values())) > 1

    ours = load_exported_model(native, export_config(native, None))
    text = "the king speak thou fair"
    ids = Tokenizer.from_file(str(trained_run / "tokenizer.json")).encode(text).ids
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tokenizer(text)["input_ids"] == ids
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.model_max_length == 32
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        assert (hf(torch.tensor([ids]), use_cache=False).logits - ours(torch.tensor([ids]))).abs().max() <= 1e-5

    state = read_hf_state(hf_dir)
    assert state.keys() == ours.state_dict().keys()
    fresh = build_model(ours.cfg, seed=9)
    assert init_from(fresh, str(hf_dir)) == hf_dir
    for name, tensor in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_init_from_refuses_an_export_with_a_nan_weight_as_generate_does(tmp_path):
    """init_from took NaN weights from an HF export and trained on NaN losses until the first checkpoint."""
    poisoned = perturbed_model("baseline")
    name = next(name for name, param in poisoned.named_parameters() if param.dim() == 2)
    with torch.no_grad():
        poisoned.get_parameter(name)[0, 0] = float("nan")
    hf_dir = write_export(poisoned, tmp_path / "hf")
    with pytest.raises(CheckpointError) as error:
        init_from(build_model(poisoned.cfg, seed=9), str(hf_dir))
    assert str(error.value) == (f"init_from={hf_dir}: {hf_dir}: tensor {name} holds 1 non-finite values (NaN or inf) "
                                f"of {poisoned.get_parameter(name).numel():,}; export a checkpoint whose weights are "
                                "finite")
