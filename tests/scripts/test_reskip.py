"""scripts.reskip: importance from the depth-mixing matrix, skip orders, and the loss/latency table."""
import json

import pytest
import torch

from conftest import fast_train_overrides
from parallel.dims import init_distributed
from scripts.reskip import ReSkipArgs, importance, main, run_reskip, skip_orders
from trainer.config import load_config
from trainer.trainer import Trainer


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, tiny_dataset):
    root = tmp_path_factory.mktemp("reskip")
    runs = {}
    for name, extra in (("block", {"variant": "block", "variant.block_size": 2}), ("baseline", {"variant": "baseline"})):
        runs[name] = root / name
        Trainer(load_config(fast_train_overrides(runs[name], tiny_dataset, steps=6, **{"optim.lr": 1e-2, **extra})),
                init_distributed()).fit()
    return runs


def val_loss_at(run_dir, step):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if r["step"] == step and "val_loss" in r][0]


def quick(run, **extra):
    return ReSkipArgs(checkpoint=str(run), batches=2, ks="0,1,2", random_seeds=2, decode_tokens=2, repeats=1, **extra)


def test_importance_is_the_mass_later_reads_give_each_sublayer():
    # L = 2, two tokens. Rows: reads before sublayer 1, 2 and the final read; columns v_0, v_1, v_2.
    m = torch.tensor([[[1.0, 0, 0], [0.3, 0.7, 0], [0.2, 0.5, 0.3]],
                      [[1.0, 0, 0], [0.9, 0.1, 0], [0.6, 0.3, 0.1]]], dtype=torch.float64)
    # I_1 = mean(0.7 + 0.5, 0.1 + 0.3) = 0.8; I_2 = mean(0.3, 0.1) = 0.2
    assert importance(m) == pytest.approx([0.8, 0.2])
    orders = skip_orders([0.8, 0.2], seeds=2)
    assert orders["attnres"] == [[2, 1]] and orders["position"] == [[2, 1]]
    assert orders["attnres"][0] == [2, 1]
    assert skip_orders([0.2, 0.8, 0.5], seeds=1)["attnres"] == [[1, 3, 2]]


@pytest.mark.slow
def test_k0_is_the_trainers_validation_loss_and_skipping_changes_it(trained_runs):
    report = run_reskip(quick(trained_runs["block"]))
    for name, rows in report["results"].items():
        assert rows[0]["k"] == 0 and rows[0]["val_loss"] == pytest.approx(val_loss_at(trained_runs["block"], 6), abs=1e-5)
        assert all(row["val_loss"] != rows[0]["val_loss"] for row in rows[1:]), name
        assert all(row["prefill_ms"] > 0 and row["decode_ms"] > 0 for row in rows)
    for name, permutations in report["orders"].items():
        assert len(permutations) == (2 if name == "random" else 1)
        assert all(sorted(order) == list(range(1, 9)) for order in permutations)
    assert len(report["importance"]) == 8
    # Block, S = 2: the final read's weights on each block are shared by its two members, so every
    # sublayer's importance is at least its final-read share; the last sublayer is read only by the final read.
    assert report["importance"]["8"] < report["importance"]["1"]


def test_baseline_order_is_by_position(trained_runs):
    report = run_reskip(quick(trained_runs["baseline"]))
    assert report["importance"] == {str(i): pytest.approx(9.0 - i) for i in range(1, 9)}
    assert report["orders"]["attnres"] == report["orders"]["position"] == [list(range(8, 0, -1))]


def test_cli_prints_the_table_and_writes_json_and_png(trained_runs, tmp_path, capsys):
    out = tmp_path / "out"
    main([f"checkpoint={trained_runs['block']}", "batches=2", "ks=0,2", "random_seeds=2", "decode_tokens=2",
          "repeats=1", f"out={out}"])
    printed = capsys.readouterr().out
    assert "order       k  val_loss  prefill_ms  decode_ms/tok  skipped" in printed
    assert "random      2" in printed and "mean of 2 seeds" in printed
    assert (out / "reskip.png").stat().st_size > 0
    report = json.loads((out / "reskip.json").read_text())
    assert [row["k"] for row in report["results"]["position"]] == [0, 2]
    assert report["results"]["position"][1]["skipped"] == [[7, 8]]


def test_bad_ks_is_one_error_line(trained_runs, capsys):
    with pytest.raises(SystemExit) as exit_code:
        main([f"checkpoint={trained_runs['block']}", "ks=0,9"])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err == "error: ks=0,9: every k must be in [0, 8] (the model's sublayers)\n"
