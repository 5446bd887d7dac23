"""scripts/plan_memory.py and parallel/memory_plan.py: parameter counts per rank, fsdp sharding, the
activation formula against scripts/bench_memory.py's measurements, the CLI's verdicts and errors."""
import contextlib
import io
import subprocess

import pytest

import scripts.plan_memory as plan_memory
from parallel.dims import Degrees
from parallel.memory_plan import MIB, activation_elements, count_rank_parameters, plan
from trainer.config import load_config

def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m scripts.plan_memory ARGS`, run in this process (its main takes argv and returns the exit
    code): a child process would spend most of its time importing torch."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_memory.main(list(args))
    return subprocess.CompletedProcess(["scripts.plan_memory", *args], code, out.getvalue(), err.getvalue())


def test_parameters_per_rank_sum_to_the_model_over_pp_tp_ep():
    cfg = load_config(["model=m"]).model
    layout = Degrees(dp=2, pp=2, tp=2, ep=2)
    counts = count_rank_parameters(cfg, layout)
    replicated = [c.rank - c.routed_experts - c.tp_split for c in counts]
    total = sum(r + c.routed_experts * layout.ep + c.tp_split * layout.tp for r, c in zip(replicated, counts))
    assert total == counts[0].total_model
    from model import build_model
    assert total == sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    assert counts[0].blocks == list(range(6)) and counts[1].blocks == list(range(6, 12))
    assert all(c.routed_experts > 0 and c.tp_split > 0 for c in counts)


def test_fsdp2_halves_parameters_gradients_and_optimizer_state():
    cfg = load_config(["model=m"]).model

    def state(layout):
        p = plan(cfg, layout, seq_len=128, micro_batch=2, microbatches=2, mode="none", device="cuda")
        return p.param_bytes + p.grad_bytes + p.optimizer_bytes

    assert state(Degrees(fsdp=2)) == pytest.approx(state(Degrees(dp=2)) / 2)
    assert state(Degrees(fsdp=4)) == pytest.approx(state(Degrees()) / 4)


@pytest.mark.parametrize("mode, measured_mib", [("none", 722.2), ("full", 60.4), ("selective", 300.7)])
def test_activation_formula_matches_bench_memory_at_model_m(mode, measured_mib):
    """scripts.bench_memory at model=m, variant=block, 2 x 256 tokens, fp32 CPU (docs/BENCHMARKS.md)."""
    cfg = load_config(["model=m"]).model
    parts = activation_elements(cfg, list(range(cfg.n_blocks)), mode, last=True, cuda=False, seq_len=256)
    planned_mib = sum(e.bytes(4) for e in parts.values()) * 2 * 256 / MIB
    assert planned_mib == pytest.approx(measured_mib, rel=0.15)


def test_cli_prints_fits_and_does_not_fit():
    fits = run_cli("model=kimi_linear_48b", "parallel.pp=4", "parallel.ep=16", "parallel.schedule=1f1b",
                   "train.seq_len=4096", "train.micro_batch=1", "--gpus", "64", "--gpu-mem-gib", "80",
                   "train.activation_checkpointing=selective")  # docs/TRAINING.md's layout
    assert fits.returncode == 0, fits.stderr
    assert "\nfits: " in fits.stdout
    assert "layout dp16_pp4_ep16: " in fits.stdout and "  total                      44.45 GiB" in fits.stdout
    verdict = plan_memory.refusal(load_config(["model=kimi_linear_48b"]), Degrees(dp=16, pp=4, ep=16))
    assert ("trainer today: runs it" if verdict is None else f"trainer today: refused ({verdict})") in fits.stdout
    ddp = run_cli("model=kimi_linear_48b", "train.seq_len=4096", "train.micro_batch=1", "--gpus", "64")
    assert ddp.returncode == 0, ddp.stderr
    assert "\ndoes not fit: " in ddp.stdout and "trainer today: runs it" in ddp.stdout


def test_search_lists_layouts_for_48b_on_64_gpus_of_80_gib():
    out = run_cli("model=kimi_linear_48b", "train.seq_len=4096", "train.micro_batch=1", "--gpus", "64",
                  "--gpu-mem-gib", "80", "--search", "--top", "400")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines()[2:] if line.strip()]
    assert len(rows) >= 1
    assert any(line.split()[1] in ("none", "full", "selective") and line.endswith("runs") for line in rows)


@pytest.mark.parametrize("args, message", [
    (["parallel.fsdp=3", "--gpus", "64"], "error: --gpus 64 is not divisible by parallel.fsdp * parallel.pp * parallel.tp = 3"),
    (["parallel.ep=3", "--gpus", "6"], "error: parallel.ep=3 must divide model.moe.n_routed_experts=8"),
    (["parallel.pp=0"], "error: parallel.pp=0 must be a positive integer"),
    (["--gpus", "0"], "error: --gpus=0 must be >= 1"),
])
def test_bad_input_is_one_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stderr.strip().startswith(message) and len(out.stderr.strip().splitlines()) == 1
