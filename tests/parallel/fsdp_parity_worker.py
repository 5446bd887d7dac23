"""Run under torchrun (gloo): one FSDP2 training step vs the same step in one process, in fp32 and (two
cases on 2 ranks) in bf16: CPU autocast, FSDP2 gathering bf16 parameters. Every rank gathers its
sharded gradients into whole ones and compares them with its own single-process copy, then takes one
AdamW step and reports its parameter + optimizer-state bytes; rank 0 prints one JSON line per case, a
CONTROL line (gradients summed instead of averaged over the data ranks) and a MEMORY line; on 2 ranks a
MUON line (3 Muon steps on sharded matrices against one process, trainer.muon.Muon and torch.optim.Muon).
On 4 ranks PIPELINE lines: fsdp=2 x pp=2 (2 chunks per rank), whose reduce-scatters it counts, in fp32
(built on meta and whole) and in bf16.

    torchrun --nproc-per-node 2 tests/parallel/fsdp_parity_worker.py      # fsdp=2
    torchrun --nproc-per-node 4 tests/parallel/fsdp_parity_worker.py      # dp=2 x fsdp=2 (HSDP), fsdp=2 x tp=2
"""
import contextlib
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from model import build_model
from model.residual import DepthGeometry
from parallel.dims import Degrees, DistInfo, build_layout
from parallel import fsdp
from parallel.engine import build_engine, cross_entropy
from parallel.gradients import sync_moe_load
from trainer.config import ParallelConfig, load_config
from trainer.muon import MatrixSlice, Muon
from tp_parity_worker import RELEASE_ATTENTION, RELEASE_MOE, variant_overrides, whole as whole_slice  # run from here

MICRO_BATCH, SEQ, MICROBATCHES = 2, 16, 2

CASES = {
    # block_size 4 and 3: AttnRes blocks span 2 and 3 transformer blocks (units of 2 and 3 blocks)
    2: [{"dp": 1, "fsdp": 2, "variant": v, "block_size": s}
        for v, s in (("baseline", 2), ("full", 1), ("block", 2), ("block", 4), ("block", 3), ("mhc", 2))]
       # bf16: FSDP2 gathers bf16 parameters under CPU autocast
       + [{"dp": 1, "fsdp": 2, "variant": v, "block_size": s, "precision": "bf16"} for v, s in (("baseline", 2),
                                                                                                ("block", 4))]
       + [{"dp": 1, "fsdp": 2, "variant": "block", "block_size": 4, "extra": RELEASE_ATTENTION},  # K3's attention
          {"dp": 1, "fsdp": 2, "variant": "block", "block_size": 4, "extra": RELEASE_MOE}],  # K3's MoE
    # fsdp=2 x tp=2: FSDP shards of tp slices (block_size 4: units of 2 blocks)
    4: [{"dp": 2, "fsdp": 2, "variant": "block", "block_size": 4}]
       + [{"dp": 1, "fsdp": 2, "tp": 2, "variant": v, "block_size": s} for v, s in (("baseline", 2), ("block", 4))],
}


def whole(tensor: torch.Tensor, name: str | None = None, engine=None) -> torch.Tensor:
    """The whole parameter (or gradient) from FSDP's shards and, for a tp slice, from the tp peers' slices."""
    tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return tensor if engine is None else whole_slice(name, tensor, engine)


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def state_bytes(model, optimizer) -> int:
    """This rank's parameters plus its AdamW moments (step counters are scalars)."""
    moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    return local_bytes(model.parameters()) + local_bytes(moments)


def adamw_bytes(model) -> int:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    return state_bytes(model, optimizer)


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def reference_step(cfg, batches, autocast) -> tuple[torch.nn.Module, torch.Tensor]:
    """One process: the mean loss over `batches`, each forward under `autocast` and its backward after, as
    the engines run them (one backward over all of them would sum the batches' gradients of autocast's
    cached bf16 weight copies in bf16)."""
    torch.manual_seed(0)
    reference = build_model(cfg)
    losses = []
    for x, y in batches:
        with autocast():
            loss = cross_entropy(reference(x), y)
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return reference, torch.stack(losses).mean()


def squared_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """(||grads - reference||², ||reference||²) over the parameters of `grads`."""
    return torch.stack([sum((g - reference[name]).pow(2).sum() for name, g in grads.items()),
                        sum(reference[name].pow(2).sum() for name in grads)])


def relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||grads - reference|| / ||reference|| over the whole model (every parameter's gradient as one
    vector). `grads`: the whole gradients this rank holds, summed over the ranks (pipeline stages hold
    disjoint parts; ranks holding the same part scale both sums alike)."""
    squares = squared_errors(grads, reference)
    dist.all_reduce(squares)
    return (squares[0] / squares[1]).sqrt().item()


def one_process_reference(cfg, batches, bf16: bool) -> dict:
    """reference_step in the case's precision, on rank 0 only (every rank would compute the same) and sent to
    the others: {"params", "grads", "loss", "load" (the MoE layers' load counts), "scale"}; for bf16, "scale"
    says how far one process in bf16 is from fp32 (the scale of bf16's own rounding), as
    {"bf16_vs_fp32": {"loss", "grad"}} (relative)."""
    reference = [None]
    if dist.get_rank() == 0:
        model, loss = reference_step(cfg, batches, bf16_autocast if bf16 else contextlib.nullcontext)
        grads = {name: p.grad for name, p in model.named_parameters()}
        scale = {}
        if bf16:
            fp32, fp32_loss = reference_step(cfg, batches, contextlib.nullcontext)
            squares = squared_errors(grads, {name: p.grad for name, p in fp32.named_parameters()})
            scale = {"bf16_vs_fp32": {"loss": abs(loss.item() / fp32_loss.item() - 1),
                                      "grad": (squares[0] / squares[1]).sqrt().item()}}
        reference = [{"params": {name: p.detach() for name, p in model.named_parameters()}, "grads": grads,
                      "loss": loss, "load": [moe.load_counts.clone() for moe in model.moe_layers()], "scale": scale}]
    dist.broadcast_object_list(reference, src=0)
    return reference[0]


def run_case(case: dict, info: DistInfo) -> dict:
    """`precision` bf16: FSDP2 gathers bf16 parameters (reducing in fp32) under CPU autocast, against one
    process under the same autocast (fp32 parameters; also against one process in fp32, as a scale)."""
    cfg = load_config(["model=xs", *variant_overrides(case["variant"]), f"variant.block_size={case['block_size']}",
                       *case.get("extra", [])])
    bf16 = case.get("precision") == "bf16"
    autocast = bf16_autocast if bf16 else contextlib.nullcontext
    data_ranks = case["dp"] * case["fsdp"]
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.model.vocab_size, (data_ranks * MICROBATCHES * MICRO_BATCH, SEQ + 1),
                           generator=generator)
    batches = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))

    reference = one_process_reference(cfg, batches, bf16)
    reference_params, reference_grads = reference["params"], reference["grads"]
    reference_loss, reference_load, scale = reference["loss"], reference["load"], reference["scale"]
    reference_norm = torch.stack([g.pow(2).sum() for g in reference_grads.values()]).sum().sqrt().item()

    tp = case.get("tp", 1)
    layout = build_layout(info, Degrees(dp=case["dp"], fsdp=case["fsdp"], tp=tp))
    parallel = ParallelConfig(dp=case["dp"], fsdp=case["fsdp"], tp=tp)
    # Built on meta and filled shard by shard (parallel.fsdp.fill_local_parts): one process's initial weights.
    engine = build_engine(build_model(cfg, device="meta"), info, layout, parallel, MICRO_BATCH, SEQ, MICROBATCHES,
                          seed=cfg.seed, precision=torch.bfloat16 if bf16 else torch.float32)
    init_error = max((whole(p.detach(), name, engine) - reference_params[name]).abs().max().item()
                     for name, p in engine.model.named_parameters())
    mine = batches[layout.data_rank * MICROBATCHES:(layout.data_rank + 1) * MICROBATCHES]
    loss = engine.forward_backward(mine, autocast, None)
    grad_norm = engine.clip_grad_norm(0.0)
    sync_moe_load(engine.model, layout)
    load_error = max([(m.load_counts - r).abs().max().item() for m, r in zip(engine.model.moe_layers(), reference_load)]
                     or [0])

    grads = {name: whole(p.grad, name, engine) for name, p in engine.model.named_parameters()}
    worst, worst_name = 0.0, ""
    for name, grad in grads.items():
        error = (grad - reference_grads[name]).abs().max().item()
        if error > worst:
            worst, worst_name = error, name

    result = torch.tensor([abs(loss.item() - reference_loss.item()), worst, abs(grad_norm - reference_norm),
                           float(load_error), init_error, relative_error(grads, reference_grads)])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    units = [[block.index for block in unit]
             for unit in fsdp.depth_block_units(list(engine.model.layers.values()),
                                                       DepthGeometry.of(engine.model.cfg))]
    sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
    return {**case, "loss": loss.item(), "loss_error": result[0].item(), "grad_error": result[1].item(),
            "worst_param": worst_name, "grad_norm": grad_norm, "grad_norm_error": result[2].item(),
            "moe_load_error": result[3].item(), "init_error": result[4].item(), "grad_rel_error": result[5].item(),
            "reference_loss": reference_loss.item(), "reference_norm": reference_norm, **scale,
            "units": units, "all_params_sharded": sharded}


def pipeline_case(info: DistInfo, on_meta: bool, bf16: bool = False) -> dict:
    """fsdp=2 x pp=2, interleaved with 2 chunks per rank, built on meta (filled shard by shard) or whole
    (sharded as it is): initial weights, one step's loss,
    gradients and norm against one process, and how many reduce-scatters the step ran (FSDP2's
    foreach_reduce, one per parameter group when the pipeline holds the sync until the last microbatch;
    one per group and microbatch if it synced every backward). `bf16`: as run_case's, the stages then
    send bf16 messages (the stream's dtype with bf16 gathered parameters)."""
    cfg = load_config(["model=xs", *variant_overrides("block"), "variant.block_size=4"])
    autocast = bf16_autocast if bf16 else contextlib.nullcontext
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.model.vocab_size, (2 * MICROBATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    batches = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))
    reference = one_process_reference(cfg, batches, bf16)
    reference_params, reference_grads = reference["params"], reference["grads"]
    reference_loss, scale = reference["loss"], reference["scale"]
    reference_norm = torch.stack([g.pow(2).sum() for g in reference_grads.values()]).sum().sqrt().item()

    layout = build_layout(info, Degrees(fsdp=2, pp=2))
    parallel = ParallelConfig(dp=1, fsdp=2, pp=2, vp=2, schedule="interleaved_1f1b")
    engine = build_engine(build_model(cfg, device="meta" if on_meta else None), info, layout, parallel, MICRO_BATCH,
                          SEQ, MICROBATCHES, seed=cfg.seed, precision=torch.bfloat16 if bf16 else torch.float32)
    init_error = max((whole(p.detach()) - reference_params[name]).abs().max().item()
                     for name, p in engine.model.named_parameters())
    reduces = []
    original = _fsdp_param_group.foreach_reduce
    _fsdp_param_group.foreach_reduce = lambda *args, **kwargs: reduces.append(1) or original(*args, **kwargs)
    try:
        mine = batches[layout.data_rank * MICROBATCHES:(layout.data_rank + 1) * MICROBATCHES]
        loss = engine.forward_backward(mine, autocast, None)
    finally:
        _fsdp_param_group.foreach_reduce = original
    grad_norm = engine.clip_grad_norm(0.0)
    grads = {name: whole(p.grad) for name, p in engine.model.named_parameters()}
    grad_error = max((g - reference_grads[name]).abs().max().item() for name, g in grads.items())
    groups = sum(len(module._get_fsdp_state()._fsdp_param_groups) for chunk in engine.runner.chunks
                 for module in chunk.modules() if isinstance(module, FSDPModule))
    result = torch.tensor([abs(loss.item() - reference_loss.item()), grad_error, abs(grad_norm - reference_norm),
                           init_error])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
    return {"on_meta": on_meta, **({"precision": "bf16"} if bf16 else {}), "loss_error": result[0].item(),
            "grad_error": result[1].item(), "grad_rel_error": relative_error(grads, reference_grads),
            "grad_norm_error": result[2].item(), "init_error": result[3].item(),
            "reference_loss": reference_loss.item(), "reference_norm": reference_norm, "reduce_scatters": len(reduces),
            "param_groups": groups, "microbatches": MICROBATCHES, "all_params_sharded": sharded, **scale,
            "comm": engine.comm_report(), "d_model": cfg.model.d_model}


def cut_read_blocks_control(info: DistInfo) -> dict:
    """Negative control: one unit per transformer block although the two-phase read batches the queries
    of an AttnRes block of 4 sublayers (2 transformer blocks)."""
    original = fsdp.depth_block_units
    fsdp.depth_block_units = lambda blocks, geometry: [[block] for block in blocks]
    try:
        return run_case({"dp": info.world_size // 2, "fsdp": 2, "variant": "block", "block_size": 4}, info)
    except Exception as error:  # noqa: BLE001 - what the cut does is the result
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    finally:
        fsdp.depth_block_units = original


def muon_case(info: DistInfo) -> dict:
    """3 Muon steps on a matrix FSDP-style sharded (Shard(0) over the ranks) against one process, for a
    wide, a tall and a square shape: the largest parameter error over the largest update, for
    trainer.muon.Muon and for torch.optim.Muon; and for trainer.muon.Muon on tp-style plain slices
    along either dim (whose learning-rate scale must be the whole matrix's)."""
    mesh = init_device_mesh("cpu", (info.world_size,))
    torch.manual_seed(0)
    errors = {"ours": {}, "torch": {}}
    for shape in ((32, 64), (64, 32), (32, 32)):
        weight, grads = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
        reference = torch.nn.Parameter(weight.clone())
        optimizer = torch.optim.Muon([reference], lr=0.02)
        for grad in grads:
            reference.grad = grad.clone()
            optimizer.step()
        for name, cls in (("ours", Muon), ("torch", torch.optim.Muon)):
            param = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
            optimizer = cls([param], lr=0.02)
            for grad in grads:
                param.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
                optimizer.step()
            error = (param.full_tensor() - reference).abs().max() / (reference - weight).abs().max()
            errors[name][f"{shape[0]}x{shape[1]}"] = error.item()
        for dim in (0, 1):  # tensor-parallel slices: plain tensors, chunk `rank` along dim
            def mine(full):
                return full.chunk(info.world_size, dim)[info.rank].clone()
            param = torch.nn.Parameter(mine(weight))
            optimizer = Muon([param], lr=0.02, slices={param: MatrixSlice(dim, dist.group.WORLD)})
            for grad in grads:
                param.grad = mine(grad)
                optimizer.step()
            error = (param - mine(reference)).abs().max() / (reference - weight).abs().max()
            errors.setdefault("ours_tp", {})[f"{shape[0]}x{shape[1]} dim {dim}"] = error.item()
    return errors


def memory(info: DistInfo) -> dict:
    """Per-rank parameter + AdamW-state bytes at model=xs, one process vs this layout."""
    cfg = load_config(["model=xs"])
    torch.manual_seed(0)
    single = adamw_bytes(build_model(cfg))
    dp, fsdp = (2, 2) if info.world_size == 4 else (1, 2)
    engine = build_engine(build_model(cfg), info, build_layout(info, Degrees(dp=dp, fsdp=fsdp)),
                          ParallelConfig(dp=dp, fsdp=fsdp), MICRO_BATCH, SEQ, MICROBATCHES)
    per_rank = torch.tensor([adamw_bytes(engine.model)], dtype=torch.float64)
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    return {"dp": dp, "fsdp": fsdp, "single_bytes": single, "max_rank_bytes": int(per_rank.item())}


def run(info: DistInfo) -> None:
    """Every check of this world size; rank 0 prints the report."""
    results = [run_case(case, info) for case in CASES[info.world_size]]
    control = cut_read_blocks_control(info)
    usage = memory(info)
    muon = muon_case(info) if info.world_size == 2 else None
    pipelines = ([pipeline_case(info, on_meta) for on_meta in (True, False)] + [pipeline_case(info, True, bf16=True)]
                 if info.world_size == 4 else [])
    if info.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        print("CONTROL " + json.dumps(control), flush=True)
        print("MEMORY " + json.dumps(usage), flush=True)
        if muon is not None:
            print("MUON " + json.dumps(muon), flush=True)
        for pipeline in pipelines:
            print("PIPELINE " + json.dumps(pipeline), flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run(DistInfo(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"), "gloo"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
