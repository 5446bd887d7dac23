"""Achieved TFLOP/s and MFU per logged step: model/flops.py's FLOPs per token x tokens per rank / step
time, divided by the device's peak (train.peak_tflops or the table; unknown, null, on a CPU)."""
import json

import pytest

from conftest import fast_train_overrides
from model.flops import training_flops_per_token
from parallel.dims import init_distributed
from trainer.config import ConfigError, load_config
from trainer.mfu import peak_for_device_name
from trainer.trainer import Trainer


def train_rows(overrides):
    cfg = load_config(overrides)
    Trainer(cfg, init_distributed()).fit()

    def refuse(constant):
        raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")
    lines = open(f"{cfg.run.dir}/metrics.jsonl").read().splitlines()
    return cfg, [row for row in map(lambda line: json.loads(line, parse_constant=refuse), lines) if "loss" in row]


def expected_tflops(cfg, row):
    per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)["total"]
    tokens_per_rank = cfg.train.global_batch * cfg.train.seq_len  # one process
    return per_token * tokens_per_rank / row["step_time_s"] / 1e12


def test_rows_carry_tflops_from_the_flops_per_token_and_mfu_against_the_given_peak(tmp_path, tiny_dataset):
    cfg, rows = train_rows(fast_train_overrides(tmp_path / "run", tiny_dataset, steps=3, **{"train.peak_tflops": 0.5}))
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["tflops"] == pytest.approx(expected_tflops(cfg, row), rel=1e-12)
        assert row["tflops"] > 0
        assert row["mfu"] == pytest.approx(row["tflops"] / 0.5, rel=1e-12)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "peak 0.5 TFLOP/s per rank" in log
    assert f"{rows[-1]['tflops']:.3g} TFLOP/s | mfu {100 * rows[-1]['mfu']:.1f}%" in log


def test_on_cpu_without_a_peak_mfu_is_null_and_tflops_still_logged(tmp_path, tiny_dataset):
    cfg, rows = train_rows(fast_train_overrides(tmp_path / "run", tiny_dataset, steps=2))
    assert len(rows) == 2
    for row in rows:
        assert row["mfu"] is None
        assert row["tflops"] == pytest.approx(expected_tflops(cfg, row), rel=1e-12)
    assert '"mfu": null' in (tmp_path / "run" / "metrics.jsonl").read_text()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "peak of cpu unknown (mfu null; set train.peak_tflops)" in log
    step_lines = [line for line in log.splitlines() if " step " in line and " loss " in line]
    assert len(step_lines) == 2
    for line in step_lines:
        assert " TFLOP/s | " in line and "mfu" not in line


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
    ("Tesla T4", None)])
def test_device_peaks_match_the_longest_name_first(name, peak):
    assert peak_for_device_name(name) == peak


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_a_peak_that_is_not_a_positive_finite_number_is_refused(value):
    with pytest.raises(ConfigError, match=r"^train\.peak_tflops=.* must be a positive finite number of TFLOP/s or null$"):
        load_config([f"train.peak_tflops={value}"])
