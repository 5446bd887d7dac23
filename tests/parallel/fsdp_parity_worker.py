"""Run under torchrun (gloo): one FSDP2 training step vs the same step in one process. Every rank
gathers its sharded gradients into whole ones and compares them with its own single-process copy,
then takes one AdamW step and reports its parameter + optimizer-state bytes; rank 0 prints one JSON
line per case, a CONTROL line (gradients summed instead of averaged over the data ranks) and a MEMORY line.
On 4 ranks a PIPELINE line: fsdp=2 x pp=2 (2 chunks per rank), whose reduce-scatters it counts.

    torchrun --nproc-per-node 2 tests/parallel/fsdp_parity_worker.py      # fsdp=2
    torchrun --nproc-per-node 4 tests/parallel/fsdp_parity_worker.py      # dp=2 x fsdp=2 (HSDP), fsdp=2 x tp=2
"""
import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

from model import build_model
from parallel.dims import DistInfo, build_layout
from parallel import fsdp
from parallel.parallelize import build_engine, cross_entropy, sync_moe_load
from trainer.config import ParallelConfig, load_config
from tp_parity_worker import whole as whole_slice  # torchrun runs this file from its directory

MICRO_BATCH, SEQ, MICROBATCHES = 2, 16, 2

CASES = {
    # block_size 4 and 3: AttnRes blocks span 2 and 3 transformer blocks (units of 2 and 3 blocks)
    2: [{"dp": 1, "fsdp": 2, "variant": v, "block_size": s}
        for v, s in (("baseline", 2), ("full", 1), ("block", 2), ("block", 4), ("block", 3), ("mhc", 2))],
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


def run_case(case: dict, info: DistInfo) -> dict:
    cfg = load_config(["model=xs", f"variant={case['variant']}", f"variant.block_size={case['block_size']}"])
    data_ranks = case["dp"] * case["fsdp"]
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.model.vocab_size, (data_ranks * MICROBATCHES * MICRO_BATCH, SEQ + 1),
                           generator=generator)
    batches = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))

    torch.manual_seed(0)
    reference = build_model(cfg)
    losses = [cross_entropy(reference(x), y) for x, y in batches]
    reference_loss = torch.stack(losses).mean()
    reference_loss.backward()
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    reference_norm = torch.stack([g.pow(2).sum() for g in reference_grads.values()]).sum().sqrt().item()
    reference_load = [moe.load_counts.clone() for moe in reference.moe_layers()]

    tp = case.get("tp", 1)
    layout = build_layout(info, case["dp"], 1, tp, 1, case["fsdp"])
    parallel = ParallelConfig(dp=case["dp"], fsdp=case["fsdp"], tp=tp)
    # Built on meta and filled shard by shard (parallel.fsdp.fill_shards): one process's initial weights.
    engine = build_engine(build_model(cfg, device="meta"), info, layout, parallel, MICRO_BATCH, SEQ, MICROBATCHES,
                          seed=cfg.seed)
    reference_params = dict(reference.named_parameters())
    init_error = max((whole(p.detach(), name, engine) - reference_params[name].detach()).abs().max().item()
                     for name, p in engine.model.named_parameters())
    mine = batches[layout.dp_rank * MICROBATCHES:(layout.dp_rank + 1) * MICROBATCHES]
    loss = engine.forward_backward(mine, contextlib.nullcontext, None)
    grad_norm = engine.clip_grad_norm(0.0)
    sync_moe_load(engine.model, layout)
    load_error = max([(m.load_counts - r).abs().max().item() for m, r in zip(engine.model.moe_layers(), reference_load)]
                     or [0])

    worst, worst_name = 0.0, ""
    for name, p in engine.model.named_parameters():
        error = (whole(p.grad, name, engine) - reference_grads[name]).abs().max().item()
        if error > worst:
            worst, worst_name = error, name

    result = torch.tensor([abs(loss.item() - reference_loss.item()), worst, abs(grad_norm - reference_norm),
                           float(load_error), init_error])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    units = [[block.index for block in unit] for unit in fsdp.shard_units(engine.model)]
    sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
    return {**case, "loss": loss.item(), "loss_error": result[0].item(), "grad_error": result[1].item(),
            "worst_param": worst_name, "grad_norm": grad_norm, "grad_norm_error": result[2].item(),
            "moe_load_error": result[3].item(), "init_error": result[4].item(), "units": units, "all_params_sharded": sharded}


def pipeline_case(info: DistInfo, on_meta: bool) -> dict:
    """fsdp=2 x pp=2, interleaved with 2 chunks per rank, built on meta (filled shard by shard) or whole
    (sharded as it is): initial weights, one step's loss,
    gradients and norm against one process, and how many reduce-scatters the step ran (FSDP2's
    foreach_reduce, one per parameter group when the pipeline holds the sync until the last microbatch;
    one per group and microbatch if it synced every backward)."""
    cfg = load_config(["model=xs", "variant=block", "variant.block_size=4"])
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.model.vocab_size, (2 * MICROBATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    batches = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))
    reference = build_model(cfg)
    reference_loss = torch.stack([cross_entropy(reference(x), y) for x, y in batches]).mean()
    reference_loss.backward()
    reference_params = dict(reference.named_parameters())
    reference_norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt().item()

    layout = build_layout(info, 1, 2, 1, 1, 2)
    parallel = ParallelConfig(dp=1, fsdp=2, pp=2, vp=2, schedule="interleaved_1f1b")
    engine = build_engine(build_model(cfg, device="meta" if on_meta else None), info, layout, parallel, MICRO_BATCH,
                          SEQ, MICROBATCHES, seed=cfg.seed)
    init_error = max((whole(p.detach()) - reference_params[name].detach()).abs().max().item()
                     for name, p in engine.model.named_parameters())
    reduces = []
    original = _fsdp_param_group.foreach_reduce
    _fsdp_param_group.foreach_reduce = lambda *args, **kwargs: reduces.append(1) or original(*args, **kwargs)
    try:
        mine = batches[layout.dp_rank * MICROBATCHES:(layout.dp_rank + 1) * MICROBATCHES]
        loss = engine.forward_backward(mine, contextlib.nullcontext, None)
    finally:
        _fsdp_param_group.foreach_reduce = original
    grad_norm = engine.clip_grad_norm(0.0)
    grad_error = max((whole(p.grad) - reference_params[name].grad).abs().max().item()
                     for name, p in engine.model.named_parameters())
    groups = sum(len(module._get_fsdp_state()._fsdp_param_groups) for chunk in engine.runner.chunks
                 for module in chunk.modules() if isinstance(module, FSDPModule))
    result = torch.tensor([abs(loss.item() - reference_loss.item()), grad_error, abs(grad_norm - reference_norm),
                           init_error])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
    return {"on_meta": on_meta, "loss_error": result[0].item(), "grad_error": result[1].item(),
            "grad_norm_error": result[2].item(), "init_error": result[3].item(), "reduce_scatters": len(reduces),
            "param_groups": groups, "microbatches": MICROBATCHES, "all_params_sharded": sharded}


def cut_read_blocks_control(info: DistInfo) -> dict:
    """Negative control: one unit per transformer block although the two-phase read batches the queries
    of an AttnRes block of 4 sublayers (2 transformer blocks)."""
    original = fsdp.shard_units
    fsdp.shard_units = lambda model: [[block] for block in model.layers.values()]
    try:
        return run_case({"dp": info.world_size // 2, "fsdp": 2, "variant": "block", "block_size": 4}, info)
    except Exception as error:  # noqa: BLE001 - what the cut does is the result
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    finally:
        fsdp.shard_units = original


def memory(info: DistInfo) -> dict:
    """Per-rank parameter + AdamW-state bytes at model=xs, one process vs this layout."""
    cfg = load_config(["model=xs"])
    torch.manual_seed(0)
    single = adamw_bytes(build_model(cfg))
    dp, fsdp = (2, 2) if info.world_size == 4 else (1, 2)
    engine = build_engine(build_model(cfg), info, build_layout(info, dp, 1, 1, 1, fsdp),
                          ParallelConfig(dp=dp, fsdp=fsdp), MICRO_BATCH, SEQ, MICROBATCHES)
    per_rank = torch.tensor([adamw_bytes(engine.model)], dtype=torch.float64)
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    return {"dp": dp, "fsdp": fsdp, "single_bytes": single, "max_rank_bytes": int(per_rank.item())}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"), "gloo")
    results = [run_case(case, info) for case in CASES[info.world_size]]
    control = cut_read_blocks_control(info)
    usage = memory(info)
    pipelines = [pipeline_case(info, on_meta) for on_meta in (True, False)] if info.world_size == 4 else []
    if info.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        print("CONTROL " + json.dumps(control), flush=True)
        print("MEMORY " + json.dumps(usage), flush=True)
        for pipeline in pipelines:
            print("PIPELINE " + json.dumps(pipeline), flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
