"""Run under torchrun (gloo, P processes): one training step under pipeline parallelism vs the same
step in one process, for many layouts in one launch. Every rank checks the gradients of the
parameters it holds against its own single-process copy; rank 0 prints one JSON line per case. On 2
processes two more cases ("precision": "bf16"): the trainer's pipeline engine at train.precision=bf16
(CPU autocast) against one process under the same autocast."""
import functools
import json

import torch
import torch.distributed as dist

from model import build_model
from parallel.dims import Degrees, DistInfo, build_layout
from parallel.engine import build_engine, cross_entropy
from parallel.pipeline.plan import PipelinePlan
from parallel.pipeline.runner import PipelineRunner, build_chunks
from parallel.pipeline.stage import AddCachedGrad
from trainer.config import ParallelConfig, load_config
from fsdp_parity_worker import bf16_autocast, reference_step, relative_error  # torchrun runs from this directory
from tp_parity_worker import RELEASE_ATTENTION, RELEASE_MOE, variant_overrides

MICRO_BATCH, SEQ = 2, 12


def cases(pp: int):
    both = [True, False]  # with and without the cross-stage block cache
    variants = [("baseline", [], [True]), ("full", [], both), ("block", ["variant.block_size=3"], both),
                ("mhc", [], [True]),
                ("block", ["variant.block_size=3", "model.moe.aux_loss_coef=0.1"], [True])]  # each stage's balance loss
    for vp in (1, 2, 3):
        if pp * vp > 6:
            continue
        schedules = ["1f1b", "gpipe"] if vp == 1 else ["interleaved_1f1b"]
        for schedule in schedules:
            for variant, extra, caches in variants:
                for cache in caches:
                    yield {"pp": pp, "vp": vp, "schedule": schedule, "variant": variant, "extra": extra,
                           "cache": cache}
    if pp == 2:  # K3's attention options across stages with the cross-stage block cache
        yield {"pp": 2, "vp": 2, "schedule": "interleaved_1f1b", "variant": "block",
               "extra": ["variant.block_size=3", *RELEASE_ATTENTION], "cache": True}
        # K3's MoE options: the latent projections and norm on both stages
        yield {"pp": 2, "vp": 1, "schedule": "1f1b", "variant": "block",
               "extra": ["variant.block_size=3", *RELEASE_MOE], "cache": True}


@functools.cache
def one_process(variant: str, extra: tuple[str, ...], microbatches: int):
    """(config, inputs, targets, the step's loss, every parameter's gradient) in one process: the same for
    every layout and schedule of a variant, so computed once per variant."""
    cfg = load_config(["model=xs", "model.n_blocks=6", *variant_overrides(variant), *extra])
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.model.vocab_size, (microbatches * MICRO_BATCH, SEQ + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(0)
    reference = build_model(cfg)
    losses = []
    for x, y in zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH)):
        loss = cross_entropy(reference(x), y)
        ((loss + reference.aux_loss()) / microbatches).backward()
        losses.append(loss.detach())
    return cfg, inputs, targets, torch.stack(losses).mean(), {n: p.grad for n, p in reference.named_parameters()}


def run_case(case: dict, rank: int) -> dict:
    microbatches = 2 * case["pp"]
    cfg, inputs, targets, reference_loss, expected = one_process(case["variant"], tuple(case["extra"]), microbatches)

    torch.manual_seed(0)
    plan = PipelinePlan(cfg.model, case["pp"], case["vp"], case["cache"])
    runner = PipelineRunner(build_chunks(build_model(cfg), plan, rank), None, torch.device("cpu"), case["schedule"],
                            microbatches, MICRO_BATCH, SEQ, cross_entropy)
    if case.get("drop_aux"):
        for chunk in runner.chunks:
            chunk.aux_loss_scale = 0.0
    loss = runner.step(inputs, targets)
    worst = max((p.grad - expected[name]).abs().max().item() for name, p in runner.rank_model.named_parameters())
    result = torch.tensor([abs(loss.item() - reference_loss.item()), worst])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return {**case, "loss_error": result[0].item(), "grad_error": result[1].item(),
            "vectors_per_token": plan.sent_vectors()}


def bf16_case(variant: str, extra: list[str], info: DistInfo) -> dict:
    """pp=2, vp=2 with the block cache, built as the trainer builds it (build_engine, precision bf16), one
    step under CPU autocast: the loss and this rank's gradients against one process under the same
    autocast (relative, whole model), and the bytes per token each transition sent."""
    cfg = load_config(["model=xs", "model.n_blocks=6", *variant_overrides(variant), *extra])
    microbatches = 4
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.model.vocab_size, (microbatches * MICRO_BATCH, SEQ + 1), generator=generator)
    batches = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))
    reference, reference_loss = reference_step(cfg, batches, bf16_autocast)
    expected = {name: p.grad for name, p in reference.named_parameters()}

    layout = build_layout(info, Degrees(pp=2))
    parallel = ParallelConfig(pp=2, vp=2, schedule="interleaved_1f1b", pp_cache=True)
    engine = build_engine(build_model(cfg, device="meta"), info, layout, parallel, MICRO_BATCH, SEQ, microbatches,
                          seed=cfg.seed, precision=torch.bfloat16)
    loss = engine.forward_backward(batches, bf16_autocast, None)
    grads = {name: p.grad for name, p in engine.model.named_parameters()}
    return {"precision": "bf16", "pp": 2, "vp": 2, "schedule": "interleaved_1f1b", "cache": True, "variant": variant,
            "extra": extra, "loss_error": abs(loss.item() - reference_loss.item()),
            "reference_loss": reference_loss.item(), "grad_rel_error": relative_error(grads, expected),
            "comm": engine.comm_report(), "d_model": cfg.model.d_model}


def run(info: DistInfo) -> None:
    """Every case of this pipeline degree (the world size) and the negative controls; rank 0 prints the report."""
    rank, pp = info.rank, info.world_size
    results = [run_case(case, rank) for case in cases(pp)]
    bf16 = [bf16_case(variant, extra, info) for variant, extra in
            (("baseline", []), ("block", ["variant.block_size=3"]))] if pp == 2 else []
    # Negative control: without the cached-gradient path the parity must break.
    original = AddCachedGrad.backward
    AddCachedGrad.backward = staticmethod(lambda ctx, grad: (grad, None))
    try:
        control = run_case({"pp": pp, "vp": 2, "schedule": "interleaved_1f1b", "variant": "block",
                            "extra": ["variant.block_size=3"], "cache": True}, rank)
    finally:
        AddCachedGrad.backward = original
    # Negative control: the stages' balance losses left out of the backward.
    aux_control = run_case({"pp": pp, "vp": 1, "schedule": "1f1b", "variant": "block", "cache": True,
                            "extra": ["variant.block_size=3", "model.moe.aux_loss_coef=0.1"], "drop_aux": True}, rank)
    if rank == 0:
        for result in results + bf16:
            print("CASE " + json.dumps(result))
        print("CONTROL " + json.dumps(control))
        print("CONTROL " + json.dumps(aux_control))


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run(DistInfo(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"), "gloo"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
