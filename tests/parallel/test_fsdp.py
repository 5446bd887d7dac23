"""FSDP2 (parallel.fsdp): one step equals one process (fsdp=2 for every residual variant, AttnRes blocks
spanning 2 and 3 transformer blocks, dp=2 x fsdp=2 HSDP, fsdp=2 x pp=2 with one reduce-scatter per
step; fsdp=2 and fsdp=2 x pp=2 in bf16 within a derived tolerance of one process in bf16), per-rank
parameter + optimizer bytes halve, the trainer trains like one process and checkpoints move between one
process and fsdp2, fsdp2_pp2 or fsdp2_ep2 both ways, layouts it does not compose with yet are refused in
one line."""
import json
from pathlib import Path

import pytest
import torch

import resume_matrix
from conftest import fast_train_overrides, launch_job, parity_job, report_lines, task_rows
from parallel.dims import init_distributed
from trainer.config import ConfigError, load_config, validate_layout
from trainer.trainer import Trainer

PARITY = {nproc: parity_job("fsdp_parity_worker", nproc) for nproc in (2, 4)}


BF16_U = torch.finfo(torch.bfloat16).eps / 2  # bf16's unit roundoff, 2^-8 (round to nearest)


def assert_bf16_like_one_process(case: dict) -> None:
    """FSDP2 in bf16 (bf16 parameters gathered, bf16 residual stream, fp32 reduction) against one process
    under the same autocast (fp32 parameters and stream; both round the matmuls' inputs to bf16). What one
    process does not round: the embedding output, the 2L = 8 stream writes (the running sum, the block
    sums) and the RMSNorm gains (8 sublayer norms and the final one, KDA's output norms, the depth reads'
    key norms): about 20 roundings of relative error <= u, rms u / sqrt(3). To first order each moves the
    gradient by as much (the pre-norms undo any scale) and independent ones add in quadrature:
    sqrt(20 / 3) u ~ 2.6 u expected, held to 4 u = 1.6e-2 on the whole-model gradient. Measured: 6.0e-3
    (baseline) and 5.1e-3 (block S=4), 1.3-1.5 u: the bound is 2.6x the worst; a gradient off by the
    data-parallel factor 2 would be 1.0. The loss and gradient norm average per-element errors of either
    sign (128 tokens; every gradient element): measured <= 8.1e-5 and 3.1e-5 relative (0.02 u, 0.01 u),
    held to u / 16 = 2.4e-4 (3x and 8x). The floor u / 16 on the gradient error says bf16 parameters were
    gathered: under the same autocast an fp32 gather matches one process to 5e-8 (the fp32 cases). One
    process in bf16 against fp32 is 3.6e-3-4.1e-3 on the gradient (bf16_vs_fp32): the rounding FSDP2's
    bf16 parameters add is of the size of autocast's own."""
    assert BF16_U / 16 < case["grad_rel_error"] < 4 * BF16_U, case
    assert case["loss_error"] < BF16_U / 16 * case["reference_loss"], case
    assert case["grad_norm_error"] < BF16_U / 16 * case["reference_norm"], case
    assert case["bf16_vs_fp32"]["grad"] > BF16_U / 16, case  # the reference ran under bf16 autocast


@pytest.mark.parametrize("nproc, expected_cases", [(2, 10), (4, 3)])
def test_one_step_under_fsdp_equals_one_process(nproc, expected_cases, launched):
    lines = {"PIPELINE": [], **report_lines(launched(PARITY[nproc]))}  # CASE, CONTROL, MEMORY, MUON, PIPELINE
    cases, (control,), (usage,) = lines["CASE"], lines["CONTROL"], lines["MEMORY"]
    print(f"model=xs parameters + AdamW state per rank: one process {usage['single_bytes']} bytes, "
          f"dp={usage['dp']} x fsdp={usage['fsdp']} {usage['max_rank_bytes']} bytes (largest rank), "
          f"ratio {usage['max_rank_bytes'] / usage['single_bytes']:.3f}")
    assert len(cases) == expected_cases
    for case in cases:
        assert case["all_params_sharded"], case
        assert case["init_error"] == 0, case  # sharded from meta: bitwise one process's initial weights
        if case.get("precision") == "bf16":
            print(f"bf16 {case['variant']} S={case['block_size']}: gradient {case['grad_rel_error']:.2e} relative "
                  f"to one process in bf16 (one process bf16 vs fp32: {case['bf16_vs_fp32']['grad']:.2e}), loss "
                  f"{case['loss_error'] / case['reference_loss']:.2e}")
            assert_bf16_like_one_process(case)
            # Near-tied router scores may flip on the bf16 stream: one token's expert moved (measured).
            assert case["moe_load_error"] <= 2, case
            continue
        assert case["loss_error"] < 2e-6, case
        assert case["grad_error"] < 2e-6, case
        assert case["grad_norm_error"] < 2e-6, case
        assert case["moe_load_error"] == 0, case  # expert load summed over every data rank
    assert sum(case.get("precision") == "bf16" for case in cases) == (2 if nproc == 2 else 0)
    if nproc == 2:  # 3 Muon steps on fsdp=2 shards against one process, per matrix shape
        (muon,) = lines["MUON"]
        print(f"Muon on shards, largest error / largest update: {muon}")
        assert all(error == 0 for error in [*muon["ours"].values(), *muon["ours_tp"].values()]), muon
        assert len(muon["ours_tp"]) == 6, muon
        # Negative control: torch's own step runs the iteration on the shards, whose partial sums differ
        # for a tall matrix (orthogonalised transposed): measured 1.8e-2 of an update.
        assert muon["torch"]["64x32"] > 1e-3, muon
    units = {case["block_size"]: case["units"] for case in cases if case["variant"] == "block"}
    assert units[4] == [[0, 1], [2, 3]]
    if nproc == 2:
        assert units[2] == [[0], [1], [2], [3]] and units[3] == [[0, 1, 2], [3]]
    # Units that cut an AttnRes block: the first sublayer's batched read meets the next unit's sharded queries.
    assert "mixed torch.Tensor and DTensor" in control["error"], control
    if nproc == 4:  # fsdp=2 x pp=2: one process's step, one reduce-scatter per FSDP group and step
        assert [(pipeline["on_meta"], pipeline.get("precision")) for pipeline in lines["PIPELINE"]] == [
            (True, None), (False, None), (True, "bf16")]
        for pipeline in lines["PIPELINE"]:
            print(f"fsdp=2 x pp=2 {pipeline.get('precision', 'fp32')}: {pipeline['reduce_scatters']} reduce-scatters "
                  f"for {pipeline['param_groups']} parameter groups and {pipeline['microbatches']} microbatches on "
                  f"rank 0, gradient {pipeline['grad_rel_error']:.2e} relative to one process")
            assert pipeline["all_params_sharded"] and pipeline["init_error"] == 0, pipeline
            assert pipeline["param_groups"] > 0 and pipeline["reduce_scatters"] == pipeline["param_groups"], pipeline
            # The messages travel in the stream's dtype: fp32, or bf16 with bf16 gathered parameters.
            element_bytes = 2 if pipeline.get("precision") == "bf16" else 4
            comm = pipeline["comm"]
            assert comm["measured_bytes_per_token"] == [n * pipeline["d_model"] * element_bytes
                                                        for n in comm["vectors_per_token"]], pipeline
            if pipeline.get("precision") == "bf16":  # measured 5.1e-3 on the gradient, as fsdp2's block S=4
                assert_bf16_like_one_process(pipeline)
                continue
            for key in ("loss_error", "grad_error", "grad_norm_error"):
                assert pipeline[key] < 2e-6, pipeline


def metrics(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: {r["step"]: r[key] for r in records if key in r} for key in ("loss", "grad_norm", "val_loss")}


def diagnostics(run_dir):
    return [json.loads(line) for line in (run_dir / "diagnostics.jsonl").read_text().splitlines()]


def single(run_dir, dataset, **extra):
    Trainer(load_config(fast_train_overrides(run_dir, dataset, steps=4, **extra)), init_distributed()).fit()


# Muon orthogonalises in bf16, which turns a gradient summed in another order (FSDP's reduce-scatter)
# into a slightly different update, and the difference grows step by step. Measured on one process,
# summation order alone (micro_batch 1 vs 2, the same gradient) moves step 4 by 1.1e-5 (loss) and 1.8e-4
# (gradient norm); fsdp2 against one process: 2.6e-6 and 6.0e-5. Held to 5e-5 and 5e-4. (That the sharded
# update is one process's to the bit, where torch's own Muon on DTensor shards is not, is the worker's
# MUON check.)
MUON_TOLERANCE = {"loss": 5e-5, "grad_norm": 5e-4, "val_loss": 5e-5}


def assert_like_reference(run, reference, tolerance: dict | None = None) -> None:
    """4 steps with one process's losses and gradient norms, and its validation loss at step 3 (rel 1e-5
    unless `tolerance` says otherwise)."""
    found, label = metrics(run), f"{run.parent.name}/{run.name}"
    rel = {"loss": 1e-5, "grad_norm": 1e-5, "val_loss": 1e-5, **(tolerance or {})}
    assert sorted(found["loss"]) == [1, 2, 3, 4], label
    for key in ("loss", "grad_norm"):
        for step, value in found[key].items():
            assert value == pytest.approx(reference[key][step], rel=rel[key]), (label, key, step)
    assert found["val_loss"][3] == pytest.approx(reference["val_loss"][3], rel=rel["val_loss"]), label


CLIP = {"train.grad_clip": 0.5}  # the gradient norms are ~0.9: clipping is active every step
# Muon on FSDP2's shards (trainer/muon.py: each matrix's update gathered and orthogonalised whole).
MUON = {**CLIP, "optim": "muon"}


@launch_job(2)
def fsdp2_runs(root, dataset):
    """One process straight through and stopped after 3 steps (here, adamw and muon); in the launch, fsdp2
    stopped after 3 steps and fsdp2 resuming the stopped single-process run."""
    single(root / "straight", dataset, **CLIP)
    single(root / "single_first", dataset, **CLIP, **{"train.stop_after": 3})
    single(root / "muon_straight", dataset, **MUON)
    single(root / "muon_single_first", dataset, **MUON, **{"train.stop_after": 3})
    return [
        fast_train_overrides(root / "fsdp_first", dataset, steps=4, parallel="fsdp2", **CLIP, **{"train.stop_after": 3}),
        fast_train_overrides(root / "single_first", dataset, steps=4, parallel="fsdp2", **CLIP),
        fast_train_overrides(root / "muon_fsdp_first", dataset, steps=4, parallel="fsdp2", **MUON,
                             **{"train.stop_after": 3}),
        fast_train_overrides(root / "muon_single_first", dataset, steps=4, parallel="fsdp2", **MUON)]


def test_fsdp2_trains_like_one_process_and_checkpoints_move_both_ways(tmp_path, tiny_dataset, launched):
    """Stopped after 3 fsdp2 steps, the run resumes in one process; a single-process checkpoint resumes
    under fsdp2; both have one process's losses and gradient norms (rel 1e-5), validation loss and
    per-block gradient RMS; the same both ways under optim=muon. A factor 2 in the gradient would double the norm; one in the LR moves the
    losses by far more than the tolerance (checked below)."""
    root = launched(fsdp2_runs)
    clip, muon = CLIP, MUON
    straight, fsdp_first, single_first = root / "straight", root / "fsdp_first", root / "single_first"
    reference = metrics(straight)
    muon_dirs = {run: root / f"muon_{run}" for run in ("straight", "fsdp_first", "single_first")}
    single(fsdp_first, tiny_dataset, **clip)
    single(muon_dirs["fsdp_first"], tiny_dataset, **muon)

    for run in (fsdp_first, single_first):
        assert_like_reference(run, reference)
    for run in ("fsdp_first", "single_first"):
        assert_like_reference(muon_dirs[run], metrics(muon_dirs["straight"]), MUON_TOLERANCE)
    # Diagnostics of step 3, written under fsdp2 in fsdp_first: whole-block gradient RMS from the shards,
    # output RMS from rank 0's first micro-batch (one process's first).
    (written,), (expected,) = diagnostics(fsdp_first), diagnostics(straight)
    assert written["step"] == expected["step"] == 3
    for kind in ("grad_rms", "output_rms"):
        assert written[kind].keys() == expected[kind].keys(), kind
        for key, value in written[kind].items():
            assert value == pytest.approx(expected[kind][key], rel=1e-5), (kind, key)

    doubled_lr = tmp_path / "doubled_lr"
    single(doubled_lr, tiny_dataset, **clip, **{"optim.lr": 2 * load_config().optim.lr, "train.stop_after": 3})
    moved = max(abs(metrics(doubled_lr)["loss"][step] / reference["loss"][step] - 1) for step in (2, 3))
    assert moved > 1e-3  # 100x the tolerance


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.fsdp=0"], "parallel.fsdp=0 must be positive"),
])
def test_bad_fsdp_settings_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as error:
        load_config(overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, world, expected", [
    (["parallel=fsdp2"], 2, (2, 1)),
    (["parallel=dp2_fsdp2", "train.micro_batch=2"], 4, (4, 2)),
    (["parallel.fsdp=4", "train.micro_batch=2"], 8, (8, 1)),   # dp=null takes what fsdp leaves: 2 replicas
])
def test_fsdp_ranks_split_the_batch_like_replicas(overrides, world, expected):
    assert validate_layout(load_config(overrides), world) == expected


@pytest.mark.parametrize("overrides, world, fragment", [
    (["parallel=dp2_fsdp2"], 2, "parallel.dp * parallel.fsdp * parallel.cp * parallel.pp * parallel.tp = 2 * 2 * 1 * 1 * 1 = 4 "
                                "does not match the 2 processes"),
    (["parallel=dp2_fsdp2"], 4, "train.global_batch=16 must be a multiple of train.micro_batch * dp * fsdp = 8 * 2 * 2"),
])
def test_fsdp_layouts_that_do_not_fit_the_processes_are_refused(overrides, world, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("*", r"\*")):
        validate_layout(load_config(overrides), world)


# The composed layouts, with the settings each needs (the resume matrix's, whose runs they share: a layout's
# step-3 checkpoint comes from the matrix's uninterrupted run of it).
COMPOSED = {layout: resume_matrix.MATRIX_SETTINGS[layout] for layout in (  # 4 ranks
    "fsdp2_pp2", "fsdp2_ep2", "fsdp2_tp2",
    "cp2_pp2")}  # context parallelism through pipeline stages
COMPOSED_8 = {layout: resume_matrix.MATRIX_SETTINGS[layout] for layout in (
    "dp2_fsdp2_pp2_ep2",  # fsdp with two of the others (ep is carved out of dp, so fsdp x ep needs 2 replicas)
    "fsdp2_cp2_tp2")}  # tp slices sharded over fsdp x cp
# fsdp with all three of pp, tp and ep (the planner's dp4_fsdp2_pp4_tp2_ep4 on 64 GPUs); it contains fsdp x tp x
# ep and fsdp x pp x tp, so those need no 8-rank composition of their own (the resume matrix runs them)
COMPOSED_16 = {"dp2_fsdp2_pp2_tp2_ep2": resume_matrix.MATRIX_SETTINGS["dp2_fsdp2_pp2_tp2_ep2"]}


def composed_runs(settings: dict, root, dataset) -> list[list[str]]:
    """Per layout: one process straight through and stopped after 3 steps (here), and for the launch the
    layout resuming one process's checkpoint (the layout's own uninterrupted run is the resume matrix's)."""
    runs = []
    for layout, extra in settings.items():
        single(root / layout / "straight", dataset, **extra)
        single(root / layout / "single_first", dataset, **extra, **{"train.stop_after": 3})
        runs.append(fast_train_overrides(root / layout / "single_first", dataset, steps=4, parallel=layout, **extra))
    return runs


def assert_composed_like_one_process(settings: dict, root, matrix, dataset) -> None:
    """The layout's run resumed in one process from its step-3 checkpoint (the resume matrix's uninterrupted
    run under `matrix`, as it stood after step 3), and one process's run resumed under the layout, both have
    one process's losses, gradient norms and validation loss (rel 1e-5)."""
    for layout, extra in settings.items():
        resume_matrix.copy_as_stopped(matrix / layout / "straight", root / layout / "mesh_first")
        single(root / layout / "mesh_first", dataset, **extra)
        reference = metrics(root / layout / "straight")
        for run in ("mesh_first", "single_first"):
            assert_like_reference(root / layout / run, reference)


# train.eval_tasks at the last step: through HSDP's own forward (each data rank scores half the rows).
HSDP = {"train.micro_batch": 1, "train.grad_clip": 0.5, "train.eval_every": 100, "train.eval_tasks": "[attnres_text]"}


@launch_job(4)
def four_rank_runs(root, dataset):
    """HSDP's run and its one-process reference (here); the composed layouts' (composed_runs)."""
    Trainer(load_config(fast_train_overrides(root / "straight_hsdp", dataset, steps=3, **HSDP)),
            init_distributed()).fit()
    return [fast_train_overrides(root / "hsdp", dataset, steps=3, parallel="dp2_fsdp2", **HSDP),
            *composed_runs(COMPOSED, root, dataset)]


def test_four_rank_fsdp_layouts_train_like_one_process_and_checkpoints_move_both_ways(tiny_dataset, launched):
    """The 4-rank layouts, in the session's 4-rank launch.

    HSDP (dp2_fsdp2: 2 replicas x 2 shards, one sequence each) for 3 steps: one process's losses, gradient
    norms, validation loss and train.eval_tasks' scores (HSDP's own forward) (rel 1e-5).
    Composed: fsdp2_pp2: 2 pipeline stages, each chunk FSDP2-sharded over 2 ranks (interleaved, 2 chunks per
    rank, so the cross-stage block cache is in use). fsdp2_ep2: 2 data ranks whose experts are split in two,
    every other parameter sharded over 2 ranks. fsdp2_tp2: tp slices (and replicated parameters) sharded over
    the 2 fsdp ranks of each tp index; checkpoints hold them as DTensors over (fsdp, tp), strided where both
    cut dim 0. cp2_pp2: 2 pipeline stages (2 chunks each), each on 2 cp ranks holding half of every sequence.
    Each layout's step-3 checkpoint resumes in one process, and a single-process checkpoint resumes
    under the layout; both have one process's losses, gradient norms (clipping active) and validation loss,
    rel 1e-5 (gradient norms 1.4-3.3: the default train.grad_clip=1.0 is active)."""
    root = launched(four_rank_runs)
    straight_hsdp, hsdp = root / "straight_hsdp", root / "hsdp"
    reference, found = metrics(straight_hsdp), metrics(hsdp)
    assert sorted(found["loss"]) == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        for step, value in found[key].items():
            assert value == pytest.approx(reference[key][step], rel=1e-5), ("hsdp", key, step)
    # 2 validation batches over 4 data ranks: ranks 2 and 3 run a forward for the shards' sake and count nothing
    assert found["val_loss"][3] == pytest.approx(reference["val_loss"][3], rel=1e-5)
    assert sorted(task_rows(hsdp)) == [3]
    assert task_rows(hsdp)[3] == pytest.approx(task_rows(straight_hsdp)[3], rel=1e-5)
    assert_composed_like_one_process(COMPOSED, root, launched(resume_matrix.JOBS[4]), tiny_dataset)


COMPOSED_JOBS = {nproc: launch_job(nproc, f"{__name__}.composed_{nproc}")(
    lambda root, dataset, layouts=layouts: composed_runs(layouts, root, dataset))
    for nproc, layouts in ((8, COMPOSED_8), (16, COMPOSED_16))}


@pytest.mark.parametrize("nproc, layouts", [(8, COMPOSED_8), (16, COMPOSED_16)], ids=["8_ranks", "16_ranks"])
def test_composed_fsdp_layouts_train_like_one_process_and_checkpoints_move_both_ways(nproc, layouts, tiny_dataset,
                                                                                    launched):
    """fsdp with two or three of the others, one torchrun launch per world size. 8 ranks: dp2_fsdp2_pp2_ep2
    (HSDP pipeline chunks with ep slices of the experts left out of fully_shard, cross-stage cache on; the
    planner recommends dpN_fsdp2_pp2_epN for kimi_linear_48b) and fsdp2_cp2_tp2 (tp slices sharded over
    fsdp x cp, checkpointed over the (fsdp_cp, tp) mesh). 16 ranks: dp2_fsdp2_pp2_tp2_ep2 (2 pipeline
    stages of tp=2 neighbours, each rank's tp slices of its chunks HSDP-sharded over 2 replicas x 2 fsdp
    shards, the experts' ep slices left out of fully_shard, cross-stage cache on). Each trains 3 steps and
    resumes both ways from one process with one process's losses, gradient norms (clipping active) and
    validation loss, rel 1e-5. Each layout's own run is the resume matrix's (tests/parallel/resume_matrix.py),
    in the same launch."""
    root, matrix = launched(COMPOSED_JOBS[nproc]), launched(resume_matrix.JOBS[nproc])
    assert_composed_like_one_process(layouts, root, matrix, tiny_dataset)
