"""Under tp/ep a model built on the meta device is sliced before any weight exists
(parallel.parallelize.materialise_parallel): each rank's slices are exactly one process's initial
weights. (The host memory this saves is a measurement, in docs/BENCHMARKS.md.)"""
from __future__ import annotations

import pytest
import torch

from model import build_model
from model.init import materialise
from parallel.dims import Degrees, DistInfo, Layout
from parallel.parallelize import materialise_parallel
from parallel.placement import placed_parameters
from trainer.config import load_config

ONE_PROCESS = DistInfo(0, 1, 0, torch.device("cpu"), None)
SEED = 3


def _layout(tp_rank: int, ep_rank: int) -> Layout:
    # Slicing needs only each rank's coordinates; no process group is touched before a forward.
    return Layout(degrees=Degrees(tp=2, ep=2), tp_rank=tp_rank, ep_rank=ep_rank)


@pytest.mark.parametrize("tp_rank,ep_rank", [(0, 1), (1, 0)])
def test_each_ranks_slices_are_one_process_initial_weights(tp_rank, ep_rank):
    cfg = load_config(["model=xs", "variant=block"])
    whole = build_model(cfg, device="meta")
    materialise(whole, "cpu", whole.cfg.init_stds, SEED)
    whole_params = dict(whole.named_parameters())
    model = build_model(cfg, device="meta")
    layout = _layout(tp_rank, ep_rank)
    materialise_parallel(model, ONE_PROCESS, layout, SEED, torch.float32)

    placements = {name: placement for name, _, placement in placed_parameters(model)}
    assert {(p.axis, p.rank, p.size) for p in placements.values() if p} == {("tp", tp_rank, 2), ("ep", ep_rank, 2)}
    assert list(placements) == [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        placement = placements[name]
        expected = whole_params[name].detach() if placement is None else placement.local(whole_params[name].detach())
        assert not param.is_meta and param.shape == expected.shape, name
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0, msg=name)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, dict(whole.named_buffers())[name], rtol=0, atol=0, msg=name)
