"""Run under torchrun (gloo): one training step with tensor/sequence, context and expert parallelism vs
the same step in one process. Every rank gathers the slices of the parameters it holds into whole
gradients and compares them with its own single-process copy; rank 0 prints one JSON line per case and
CONTROL lines (replicated gradients not completed over tp; on 2 ranks also the balance loss over each
rank's slice of the sequences instead of the whole sequence, and cp without KDA's state passing).

    torchrun --nproc-per-node 2 tests/parallel/tp_parity_worker.py      # tp=2, dp=2 x ep=2, cp=2 (K3's attention too)
    torchrun --nproc-per-node 4 tests/parallel/tp_parity_worker.py      # tp=2 x pp=2, dp=2 x tp=2 x ep=2, cp=2 x tp=2, fsdp=2 x cp=2, cp=4, dp=2 x cp=2 x ep=2
"""
import contextlib
import json

import torch
import torch.distributed as dist

from model import build_model
from model.moe import MoE
from parallel.dims import Degrees, DistInfo, build_layout
from parallel import gradients
from parallel.engine import build_engine, cross_entropy
from parallel.gradients import sync_moe_load
from parallel.context import ContextSplit
from parallel.placement import placement_of
from parallel.tensor import local_sequence
from torch.distributed.tensor import DTensor
from trainer.config import ParallelConfig, load_config

MICRO_BATCH, SEQ, MICROBATCHES = 2, 16, 2
# K3's attention options (issue 56) all on at model=xs: MLA's query LoRA, output gate and latent norms' eps, KDA's
# lower-bounded forget gate and full-rank output gate without a bias, an explicit MLA list (blocks 1 and 3).
RELEASE_ATTENTION = ["model.mla.q_lora_rank=16", "model.mla.output_gate=true", "model.mla.latent_norm_eps=1e-6",
                     "model.kda.gate_lower_bound=-5.0", "model.kda.full_rank_output_gate=true",
                     "model.kda.output_gate_bias=false", "model.mla_layers=[1,3]"]
# K3's MoE options (issue 56) all on at model=xs: SiTU in every MLP, LatentMoE in half the width with its norm,
# grouped top-k (2 groups of 2 experts, the better group kept).
RELEASE_MOE = ["model.moe.activation=situ", "model.moe.latent_dim=48", "model.moe.latent_norm=true",
               "model.moe.n_expert_groups=2", "model.moe.topk_groups=1"]

CASES = {
    2: [{"dp": 1, "pp": 1, "tp": 2, "ep": 1, "variant": v} for v in ("baseline", "full", "block")]
       + [{"dp": 2, "pp": 1, "tp": 1, "ep": 2, "variant": "block"},
          # every token routed to experts 0 and 1: the second ep rank receives nothing
          {"dp": 2, "pp": 1, "tp": 1, "ep": 2, "variant": "baseline", "skewed": True},
          # the sequence-level balance loss, whose sequences each tp rank holds a slice of
          {"dp": 1, "pp": 1, "tp": 2, "ep": 1, "variant": "block", "aux_loss_coef": 0.1},
          {"dp": 1, "pp": 1, "tp": 2, "ep": 1, "variant": "mhc"}]  # m streams, each sequence-sharded
       # context parallelism: KDA passes state, MLA reads the earlier slices' latents
       + [{"dp": 1, "pp": 1, "tp": 1, "ep": 1, "cp": 2, "variant": v} for v in ("baseline", "full", "block")]
       + [{"dp": 1, "pp": 1, "tp": 1, "ep": 1, "cp": 2, "variant": "block", "aux_loss_coef": 0.1}]
       # K3's attention options: q_b_proj and both g_proj split by head, the query latent replicated
       + [{"dp": 1, "pp": 1, "tp": 2, "ep": 1, "variant": "block", "extra": RELEASE_ATTENTION},
          {"dp": 1, "pp": 1, "tp": 1, "ep": 1, "cp": 2, "variant": "block", "extra": RELEASE_ATTENTION}]
       # K3's MoE options: the MoE replicated under tp; under ep the latent rows dispatched, and (skewed) the
       # second rank's experts idle
       + [{"dp": 1, "pp": 1, "tp": 2, "ep": 1, "variant": "block", "extra": RELEASE_MOE},
          {"dp": 2, "pp": 1, "tp": 1, "ep": 2, "variant": "block", "skewed": True, "extra": RELEASE_MOE}],
    4: [{"dp": 1, "pp": 2, "tp": 2, "ep": 1, "variant": v, "vp": 2} for v in ("baseline", "block")]
       + [{"dp": 2, "pp": 1, "tp": 2, "ep": 2, "variant": "block"},
          {"dp": 1, "pp": 1, "tp": 2, "ep": 1, "cp": 2, "variant": "block"},
          *({"dp": 1, "fsdp": 2, "pp": 1, "tp": 1, "ep": 1, "cp": 2, "variant": v} for v in ("baseline", "full", "block")),
          {"dp": 1, "pp": 1, "tp": 1, "ep": 1, "cp": 4, "variant": "block"},  # a chain over three earlier slices
          {"dp": 2, "pp": 1, "tp": 1, "ep": 2, "cp": 2, "variant": "block"}],  # experts averaged over dp x cp
}


def whole(name: str, grad: torch.Tensor, engine) -> torch.Tensor:
    """The full gradient of a parameter this rank may hold only a slice (or FSDP's shard) of."""
    if isinstance(grad, DTensor):
        grad = grad.full_tensor()
    placement = placement_of(engine.model, name)
    if placement is None:
        return grad
    dim = placement.dim
    group = engine.layout.tp_group if placement.axis == "tp" else engine.layout.ep_group
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class DispatchedWidths:
    """Wraps a MoE's run_experts (under ep: the all-to-all dispatch) and records the width of the rows sent."""

    def __init__(self, run_experts):
        self.run_experts, self.widths = run_experts, set()

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        self.widths.add(x_sorted.shape[-1])
        return self.run_experts(x_sorted, counts)


def skew(model, case: dict):
    """With case["skewed"], bias the routers so every token picks experts 0 and 1."""
    if case.get("skewed"):
        for moe in model.moe_layers():
            moe.expert_bias[:2] = 100.0
    return model


def variant_overrides(variant: str) -> list[str]:
    """`variant=NAME`; Block with the two-phase read a GPU takes (two_phase=null reads per layer on CPU), so
    the parity runs cover its phase-1 caches across units, stages, slices and checkpoints. Full covers the
    per-layer read."""
    return [f"variant={variant}"] + (["variant.two_phase=true"] if variant == "block" else [])


def one_process_step(cfg, case: dict, tokens: torch.Tensor, batches: list) -> tuple:
    """The step in one process: its loss, every gradient, the experts' loads, the gradient norm, and how many
    elements the unsharded model's block storage holds (the sources of the final read)."""
    torch.manual_seed(0)
    reference = skew(build_model(cfg), case)
    losses, aux_losses = [], []
    for x, y in batches:
        losses.append(cross_entropy(reference(x), y))
        aux_losses.append(reference.aux_loss())  # trained on, not reported: the engines report the LM loss
    loss = torch.stack(losses).mean()
    (loss + torch.stack(aux_losses).mean()).backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    loads = {name: m.load_counts.clone() for name, m in reference.named_modules() if isinstance(m, MoE)}
    norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt().item()
    with torch.no_grad():
        state = reference.forward_layers(reference.mixer.start(reference.embed(tokens[:MICRO_BATCH, :-1])))
    return loss.item(), grads, loads, norm, sum(b.numel() for b in state.blocks)


def run_case(case: dict, info: DistInfo) -> dict:
    cfg = load_config(["model=xs", *variant_overrides(case["variant"]), "variant.block_size=2",
                       f"model.moe.aux_loss_coef={case.get('aux_loss_coef', 0.0)}", *case.get("extra", [])])
    dp, fsdp, cp = case["dp"], case.get("fsdp", 1), case.get("cp", 1)
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.model.vocab_size, (dp * fsdp * MICROBATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    batches = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))

    # One process's step, on rank 0 only (every rank would compute the same), then sent to the others.
    single = [one_process_step(cfg, case, tokens, batches) if info.rank == 0 else None]
    dist.broadcast_object_list(single, src=0)
    reference_loss, reference_grads, reference_loads, reference_norm, reference_block_elements = single[0]

    layout = build_layout(info, Degrees(dp=dp, fsdp=fsdp, pp=case["pp"], tp=case["tp"], ep=case["ep"], cp=cp))
    parallel = ParallelConfig(dp=dp, fsdp=fsdp, pp=case["pp"], tp=case["tp"], ep=case["ep"], vp=case.get("vp", 1), cp=cp)
    torch.manual_seed(0)
    engine = build_engine(skew(build_model(cfg), case), info, layout, parallel, MICRO_BATCH, SEQ, MICROBATCHES)
    dispatches = [DispatchedWidths(moe.run_experts) for moe in engine.model.moe_layers()]
    for moe, dispatch in zip(engine.model.moe_layers(), dispatches):
        moe.run_experts = dispatch
    if case.get("slice_balance_loss"):  # the control: each rank's balance loss over its slice of the sequence
        for moe in engine.model.moe_layers():
            del moe.sequence_totals
    if case.get("no_state_passing"):  # the control: every cp slice's KDA recurrence starts from zero
        for module in engine.model.modules():
            if isinstance(getattr(module, "sequence_split", None), ContextSplit) and hasattr(module, "conv_kernel"):
                module.sequence_split.start_state = lambda final, transition: torch.zeros_like(final)
    mine = batches[layout.data_rank * MICROBATCHES:(layout.data_rank + 1) * MICROBATCHES]
    loss = engine.forward_backward(mine, contextlib.nullcontext, None)
    grad_norm = engine.clip_grad_norm(1e9)
    # Expert load summed over the ranks that routed different tokens: each token counted once, as in one process.
    sync_moe_load(engine.model, layout)
    load_error = max((m.load_counts - reference_loads[name]).abs().max().item()
                     for name, m in engine.model.named_modules() if isinstance(m, MoE))

    worst, worst_name = 0.0, ""
    for name, p in engine.model.named_parameters():
        error = (whole(name, p.grad, engine) - reference_grads[name]).abs().max().item()
        if error > worst:
            worst, worst_name = error, name

    block_elements = -1
    if case["pp"] == 1 and fsdp == 1:  # a whole model here, called part by part (FSDP gathers in its root's forward)
        with torch.no_grad():
            local = local_sequence(tokens[:MICRO_BATCH, :-1], layout)
            state = engine.model.forward_layers(engine.model.mixer.start(engine.model.embed(local)))
            block_elements = sum(b.numel() for b in state.blocks)

    result = torch.tensor([abs(loss.item() - reference_loss), worst, abs(grad_norm - reference_norm)])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return {**case, "loss": loss.item(), "loss_error": result[0].item(), "grad_error": result[1].item(),
            "load_error": load_error, "dispatched_widths": sorted(set().union(*(d.widths for d in dispatches))),
            "worst_param": worst_name, "grad_norm_error": result[2].item(), "block_elements": block_elements,
            "reference_block_elements": reference_block_elements,
            "block_elements_formula": (len(state.blocks) * MICRO_BATCH * SEQ // (case["tp"] * cp) * cfg.model.d_model
                                       if block_elements >= 0 else -1)}


def run(info: DistInfo) -> None:
    """Every case of this world size and the negative controls; rank 0 prints the report."""
    results = [run_case(case, info) for case in CASES[info.world_size]]
    # Negative control: without completing the replicated gradients over tp the parity must break.
    original = gradients.reduce_replicated_grads
    gradients.reduce_replicated_grads = lambda model, group: None
    try:
        control = run_case({"dp": info.world_size // 2, "pp": 1, "tp": 2, "ep": 1, "variant": "block"}, info)
    finally:
        gradients.reduce_replicated_grads = original
    extra_controls = ([run_case({"dp": 1, "pp": 1, "tp": 2, "ep": 1, "variant": "block", "aux_loss_coef": 0.1,
                                 "slice_balance_loss": True}, info),
                       run_case({"dp": 1, "pp": 1, "tp": 1, "ep": 1, "cp": 2, "variant": "block",
                                 "no_state_passing": True}, info)] if info.world_size == 2 else [])
    if info.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        print("CONTROL " + json.dumps(control), flush=True)
        for extra in extra_controls:
            print("CONTROL " + json.dumps(extra), flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run(DistInfo(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"), "gloo"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
