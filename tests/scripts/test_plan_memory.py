"""scripts/plan_memory.py and parallel/memory_plan.py: parameter counts per rank, fsdp sharding, the
activation formula against scripts/bench/memory.py's measurements, the CLI's verdicts and errors."""
import contextlib
import io
import subprocess

import pytest
import torch

import scripts.plan_memory as plan_memory
from parallel.context import ContextSplit
from parallel.dims import Degrees
from parallel.memory_plan import (GIB, MIB, activation_elements, candidate_layouts, count_rank_parameters,
                                  kda_elements, mla_elements, plan, search)
from scripts.bench.memory import StorageTracker
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
    """scripts.bench memory at model=m, variant=block, 2 x 256 tokens, fp32 CPU (docs/BENCHMARKS.md)."""
    cfg = load_config(["model=m"]).model
    parts = activation_elements(cfg, list(range(cfg.n_blocks)), mode, last=True, cuda=False, seq_len=256)
    planned_mib = sum(e.bytes(4) for e in parts.values()) * 2 * 256 / MIB
    assert planned_mib == pytest.approx(measured_mib, rel=0.15)


def test_cli_prints_fits_and_does_not_fit():
    fits = run_cli("model=kimi_linear_48b", "parallel.pp=4", "parallel.ep=16", "parallel.schedule=1f1b",
                   "train.seq_len=4096", "train.micro_batch=1", "gpus=64", "gpu_mem_gib=80",
                   "train.activation_checkpointing=selective")  # docs/TRAINING.md's layout
    assert fits.returncode == 0, fits.stderr
    assert "\nfits: " in fits.stdout
    assert "layout dp16_pp4_ep16: " in fits.stdout and "  total                      44.45 GiB" in fits.stdout
    verdict = plan_memory.refusal(load_config(["model=kimi_linear_48b"]), Degrees(dp=16, pp=4, ep=16))
    assert ("trainer today: runs it" if verdict is None else f"trainer today: refused ({verdict})") in fits.stdout
    ddp = run_cli("model=kimi_linear_48b", "train.seq_len=4096", "train.micro_batch=1", "gpus=64")
    assert ddp.returncode == 0, ddp.stderr
    assert "\ndoes not fit: " in ddp.stdout and "trainer today: runs it" in ddp.stdout


def test_search_lists_layouts_for_48b_on_64_gpus_of_80_gib():
    out = run_cli("model=kimi_linear_48b", "train.seq_len=4096", "train.micro_batch=1", "gpus=64",
                  "gpu_mem_gib=80", "search=true", "top=400")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines()[2:] if line.strip()]
    assert len(rows) >= 1
    assert any(line.split()[2] in ("none", "full", "selective") and line.endswith("runs") for line in rows)


@pytest.mark.parametrize("args, message", [
    (["parallel.fsdp=3", "gpus=64"],
     "error: gpus=64 is not divisible by parallel.fsdp * parallel.cp * parallel.pp * parallel.tp = 3"),
    (["parallel.cp=3", "gpus=6", "train.seq_len=128"],
     "error: train.seq_len=128 must be divisible by parallel.cp * parallel.tp = 3 * 1"),
    (["parallel.ep=3", "gpus=6"], "error: model.moe.n_routed_experts=8 must be divisible by parallel.ep=3"),
    (["parallel.pp=0"], "error: parallel.pp=0 must be a positive integer"),
    (["gpus=0"], "error: gpus=0 must be >= 1"),
])
def test_bad_input_is_one_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stderr.strip().startswith(message) and len(out.stderr.strip().splitlines()) == 1


# -- context parallelism --------------------------------------------------------------------------------

LONG = ["model=kimi_linear_48b", "train.seq_len=131072", "train.micro_batch=1", "gpus=64", "gpu_mem_gib=80"]


class LastRankOfLocalSplit(ContextSplit):
    """ContextSplit as the last of `size` ranks sees it, in one process: every gather returns `size` copies
    of this rank's tensor, in a fresh storage as the collective's output is. MLA scores this slice's own
    queries (no balancing): the last rank of a contiguous split, the bound the planner uses (T/cp queries
    over all T keys; the balanced pieces see fewer keys on average)."""

    def _gather(self, x):
        return x.unsqueeze(0).expand(self.size, *x.shape).contiguous()  # (size, ...)

    def scored_pieces(self, length):
        return [(self.rank * length, length)]

    def balance(self, x):
        return x

    def unbalance(self, x):
        return x


# K3's token mixers (issue 56): MLA's query LoRA and output gate, KDA's lower-bounded gate and full-rank output gate.
RELEASE_ATTENTION = ["model.mla.q_lora_rank=192", "model.mla.output_gate=true", "model.kda.gate_lower_bound=-5.0",
                     "model.kda.full_rank_output_gate=true", "model.kda.output_gate_bias=false"]


@pytest.mark.parametrize("cp, options", [(1, []), (2, []), (4, []), (1, RELEASE_ATTENTION), (2, RELEASE_ATTENTION)],
                         ids=["cp1", "cp2", "cp4", "cp1-release", "cp2-release"])
def test_token_mixers_under_cp_match_the_storage_tracker(cp, options):
    """What a KDA and an MLA layer keep for backward on the last cp rank (CPU, fp32, model=m), measured
    op by op (scripts/bench/memory.py's tracker) against kda_elements / mla_elements; with K3's options too."""
    from model.kda import KimiDeltaAttention
    from model.mla import MultiHeadLatentAttention
    cfg = load_config(["model=m", *options]).model
    batch, seq_len = 2, 512
    tokens = batch * seq_len // cp
    planned = {"kda": kda_elements(cfg, "none", False, cp, seq_len),
               "mla": mla_elements(cfg, "none", False, seq_len // cp, seq_len)}
    torch.manual_seed(0)
    for name, mixer in (("kda", KimiDeltaAttention(cfg)), ("mla", MultiHeadLatentAttention(cfg))):
        if cp > 1:
            mixer.sequence_split = LastRankOfLocalSplit(None, cp - 1, cp)
        x = torch.randn(batch, seq_len // cp, cfg.d_model, requires_grad=True)
        with StorageTracker(mixer) as tracker:
            out = mixer(x)
        measured = tracker.current - out.untyped_storage().nbytes()
        planned_bytes = (planned[name].bytes(4) - cfg.d_model * 4) * tokens  # x, the input, is not tracked
        assert planned_bytes == pytest.approx(measured, rel=0.1), name


def test_token_local_activations_fall_as_one_over_cp():
    """Under full checkpointing a rank keeps only token-local tensors (the AttnRes block storage, the head's
    log-softmax): exactly 1/cp of them. Inside a KDA block, cp adds its augmented run: still far below cp=1."""
    cfg = load_config(["model=kimi_linear_48b"]).model
    seq_len = 131072

    def activations(cp, mode):
        return plan(cfg, Degrees(fsdp=8 // cp, cp=cp), seq_len=seq_len, micro_batch=1, microbatches=1,
                    mode=mode).activations_by_mode[mode]

    for cp in (2, 4, 8):
        assert activations(cp, "full") == pytest.approx(activations(1, "full") / cp)
    kda_block = next(b for b in range(cfg.n_blocks) if not cfg.is_mla(b))
    for cp in (2, 8):
        whole = activation_elements(cfg, [kda_block], "none", last=False, cuda=True, seq_len=seq_len)
        sliced = activation_elements(cfg, [kda_block], "none", last=False, cuda=True, seq_len=seq_len, cp=cp)
        whole_bytes = sum(e.bytes(2) for e in whole.values()) * seq_len
        rank_bytes = sum(e.bytes(2) for e in sliced.values()) * seq_len / cp
        assert whole_bytes / cp < rank_bytes < 1.3 * whole_bytes / cp


def test_mla_last_cp_rank_keeps_keys_and_values_of_the_whole_sequence():
    """The last rank recomputes K and V for all T tokens from the gathered latents (r + p per token) and
    its T/cp queries score all T keys (CPU: the probabilities H x T/cp x T)."""
    cfg = load_config(["model=kimi_linear_48b"]).model
    m, H, T, cp = cfg.mla, cfg.n_heads, 131072, 8
    n, p, r, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
    for cuda, key_side in ((True, H * (n + p) + H * (n + v)), (False, H * (n + p) + H * v)):
        whole = mla_elements(cfg, "none", cuda, T).a * T
        last_rank = mla_elements(cfg, "none", cuda, T // cp, T).a * (T // cp)
        query_side = whole - key_side * T - (0 if cuda else H * T * T)
        expected = query_side / cp + (key_side + r + p) * T + (0 if cuda else H * T // cp * T)
        assert last_rank == pytest.approx(expected)


def test_parameter_state_is_sharded_over_fsdp_times_cp_and_replicated_without_fsdp():
    cfg = load_config(["model=m"]).model

    def planned(layout):
        return plan(cfg, layout, seq_len=128, micro_batch=2, microbatches=2, mode="none", device="cuda")

    def state(layout):
        p = planned(layout)
        return p.param_bytes + p.grad_bytes + p.optimizer_bytes

    assert state(Degrees(fsdp=2, cp=2)) == pytest.approx(state(Degrees(fsdp=4)))
    assert state(Degrees(fsdp=2, cp=4)) == pytest.approx(state(Degrees()) / 8)
    assert state(Degrees(cp=4)) == pytest.approx(state(Degrees()))
    assert planned(Degrees(cp=2)).ddp_bucket_bytes == planned(Degrees(dp=2)).ddp_bucket_bytes > 0  # DDP over dp x cp


@pytest.fixture(scope="module")
def long_search():
    """The 48B at 128K tokens on 64 x 80 GiB, with the per-layer depth read (variant.two_phase=false):
    the two-phase read cannot cut a depth block of 7 sublayers, so its FSDP units are 7 transformer blocks
    (13 B parameters, 104 GiB gathered with their gradients) and nothing fits."""
    overrides = ["model=kimi_linear_48b", "variant.two_phase=false"]
    cfg = load_config(overrides)
    found = search(cfg.model, gpus=64, gpu_bytes=80 * GIB, headroom=0.10, seq_len=131072, micro_batch=1,
                   global_batch=512)
    return cfg, found


@pytest.mark.slow
def test_48b_at_128k_on_64_gpus_of_80_gib_fits_with_cp_only(long_search):
    _, found = long_search
    assert found and all(p.layout.cp > 1 for p in found)
    out = run_cli(*LONG, "variant.two_phase=false", "search=true")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:] if line.strip()]
    assert rows[0][:3] == [found[0].layout.name(), str(found[0].layout.cp), found[0].mode]
    assert all(int(row[1]) > 1 and row[-1] == "runs" for row in rows)
    default = run_cli(*LONG, "search=true")
    assert default.returncode == 0 and default.stdout.startswith("0 layouts fit"), default.stdout


def test_every_cp_layout_the_search_recommends_passes_the_trainer_validation(long_search):
    cfg, found = long_search
    assert [p.layout for p in found if plan_memory.refusal(cfg, p.layout) is not None] == []
    small = load_config(["model=m", "train.seq_len=16"])  # 16 / cp >= conv_kernel - 1 leaves out cp = 8, 16
    layouts = [layout for layout in candidate_layouts(small.model, 16, 16) if layout.cp > 1]
    assert {layout.cp for layout in layouts} == {2, 4}
    assert any(layout.ep > 1 for layout in layouts) and any(layout.fsdp > 1 and layout.tp > 1 for layout in layouts)
    assert [(layout, plan_memory.refusal(small, layout)) for layout in layouts
            if plan_memory.refusal(small, layout) is not None] == []


@pytest.mark.parametrize("options", [[], ["model.moe.activation=situ", "model.moe.latent_dim=128",
                                          "model.moe.latent_norm=true", "model.moe.n_expert_groups=4"]],
                         ids=["default", "release"])
def test_moe_matches_the_storage_tracker(options):
    """What an MoE layer keeps for backward (CPU, fp32, model=m), measured op by op against moe_elements; with
    K3's options (SiTU's fp32 terms, LatentMoE's rows in the latent width) too. Measured 0.95 of the tracker
    for both (the CPU's reference norm keeps one more latent row than the fused kernel the plan counts)."""
    from model.init import initialise
    from model.moe import MoE
    from parallel.memory_plan import moe_elements
    cfg = load_config(["model=m", *options]).model
    torch.manual_seed(0)
    moe = MoE(cfg)
    initialise(moe, cfg.init_stds, 0)
    x = torch.randn(2, 512, cfg.d_model, requires_grad=True)
    with StorageTracker(moe) as tracker:
        out = moe(x)
    measured = tracker.current - out.untyped_storage().nbytes()
    planned = (moe_elements(cfg, "none", 1.0).bytes(4) - cfg.d_model * 4) * 2 * 512  # x, the input, is not tracked
    assert planned == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("two_phase, vectors", [(True, 28), (False, 4)])
def test_only_the_two_phase_read_keeps_a_depth_blocks_phase_1_across_transformer_blocks(two_phase, vectors):
    """K3's first three blocks (a pipeline stage of 32): the embedding b_0 and the partial sum after each block
    cross the boundaries; the two-phase read adds the phase-1 output of its depth block of 24 sublayers,
    alive until its last member reads. The per-layer read has none."""
    cfg = load_config(["model=kimi_k3", f"variant.two_phase={str(two_phase).lower()}"]).model
    parts = activation_elements(cfg, [0, 1, 2], "full", last=False, cuda=True, seq_len=8192)
    assert parts["depth_state"].a == vectors * cfg.d_model
