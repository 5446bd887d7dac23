"""data.document_masking=true in the trainer (issue 27, item 4): the engines pass the window's document starts
to the model in training and evaluation, computed on the whole sequence before tensor parallelism slices it,
through activation checkpointing, and the distributed layouts train like one process with it. The masking
itself (no token sees an earlier document) is pinned down in tests/model/test_document_masking.py."""
import contextlib
import json
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import WORDS, fast_train_overrides, launch_job
from model.document_masking import document_starts
from parallel.dims import init_distributed
from trainer.config import load_config
from trainer.data import prepare_text_corpus
from trainer.trainer import Trainer


def prepare_short_documents(root):
    """300 documents of 1-3 sentences (about 10-40 tokens): every 32-token window crosses a document end."""
    rng = random.Random(1)
    (root / "texts").mkdir(parents=True)
    for i in range(300):
        sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "."
                     for _ in range(rng.randint(1, 3)))
        (root / "texts" / f"doc{i:03d}.txt").write_text(" ".join(sentences) + "\n")
    return prepare_text_corpus([root / "texts"], root / "prepared", 512)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    return prepare_short_documents(tmp_path_factory.mktemp("short_documents"))


def masked_trainer(run, dataset, **extra):
    return Trainer(load_config(fast_train_overrides(run, dataset, steps=3, **{"data.document_masking": "true",
                                                                               **extra})), init_distributed())


def test_the_engine_masks_documents_in_the_step_and_in_evaluation(tmp_path, short_documents):
    trainer = masked_trainer(tmp_path / "run", short_documents)
    try:
        eot = trainer.samples.blend.eot_id
        (inputs, targets), = trainer.samples.val_batches(2, 1)
        starts = document_starts(inputs, eot)
        assert starts.any(dim=1).all()  # every row holds a later document
        model = trainer.model

        def loss(**kwargs):
            return F.cross_entropy(model(inputs, **kwargs).flatten(0, 1), targets.flatten())

        masked, unmasked = loss(document_starts=starts), loss()
        assert abs(masked.item() - unmasked.item()) > 1e-3  # the control: masking changes what is computed
        loss_sum, tokens = trainer.engine.loss_totals([(inputs, targets)], contextlib.nullcontext)
        assert loss_sum / tokens == pytest.approx(masked.item(), rel=1e-6)

        expected = torch.autograd.grad(masked, [p for p in model.parameters()], allow_unused=True)
        model.zero_grad()
        step_loss = trainer.engine.forward_backward([(inputs, targets)], contextlib.nullcontext, None)
        assert step_loss.item() == pytest.approx(masked.item(), rel=1e-6)
        for (name, p), grad in zip(model.named_parameters(), expected):
            if grad is not None:
                torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        trainer.close()


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_masked_losses(tmp_path, short_documents):
    for mode in ("none", "full", "selective"):
        trainer = masked_trainer(tmp_path / mode, short_documents, **{"train.activation_checkpointing": mode})
        trainer.fit()
    assert sorted(losses(tmp_path / "none")) == [1, 2, 3]
    assert losses(tmp_path / "full") == losses(tmp_path / "none")
    assert losses(tmp_path / "selective") == losses(tmp_path / "none")


LAYOUTS = ("dp2", "tp2", "fsdp2", "cp2", "pp2", "pp2_vp2")


@launch_job(2)
def layout_runs(root, _):
    """The layouts' runs, on short documents prepared here (the same tokens as the short_documents fixture's)."""
    dataset = prepare_short_documents(root / "short_documents")
    return [fast_train_overrides(root / layout, dataset, steps=3, parallel=layout, **{"data.document_masking": "true"})
            for layout in LAYOUTS]


def test_masked_training_under_dp_tp_fsdp_cp_and_pp_is_one_process(tmp_path, short_documents, launched):
    """dp2, tp2 (sequence-sharded: the starts come from the whole sequence), fsdp2, cp2 (each slice's
    documents continue from the earlier slice's: convolution windows, KDA's state, MLA's keys), pp2 and
    pp2_vp2 (every stage gets its microbatch's starts from the schedule), in the session's 2-rank launch."""
    root, layouts = launched(layout_runs), LAYOUTS
    masked_trainer(tmp_path / "single", short_documents).fit()
    masked_trainer(tmp_path / "unmasked", short_documents, **{"data.document_masking": "false"}).fit()
    reference = losses(tmp_path / "single")
    assert abs(losses(tmp_path / "unmasked")[1] - reference[1]) > 1e-4  # the control
    for layout in layouts:
        found = losses(root / layout)
        assert sorted(found) == [1, 2, 3], layout
        for step, value in found.items():
            assert value == pytest.approx(reference[step], rel=1e-5), (layout, step)
