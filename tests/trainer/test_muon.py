"""trainer.muon.Muon: on plain tensors it is torch.optim.Muon's step to the bit (its reference); on a
DTensor it orthogonalises the whole matrix. Multi-rank parity (fsdp2 x Muon against one process) is in
tests/parallel/test_fsdp.py."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.muon import Muon


def run_steps(optimizer_cls, weights, grads, **kwargs):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    optimizer = optimizer_cls(params, lr=0.02, weight_decay=0.1, **kwargs)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("nesterov", [True, False])
def test_plain_tensors_take_torchs_muon_step_to_the_bit(nesterov):
    torch.manual_seed(0)
    shapes = [(6, 16), (16, 6), (8, 8)]  # wide, tall (orthogonalised transposed), square
    weights = [torch.randn(shape) for shape in shapes]
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(3)]
    ours, optimizer = run_steps(Muon, weights, grads, nesterov=nesterov)
    reference, _ = run_steps(torch.optim.Muon, weights, grads, nesterov=nesterov)
    for mine, theirs, start in zip(ours, reference, weights):
        assert not torch.equal(mine, start)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # torch's state layout, so checkpoints hold the same entries
    assert set(optimizer.state_dict()["state"][0]) == {"momentum_buffer"}


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_dtensor_parameter_steps_like_the_plain_tensor(one_rank_group):
    torch.manual_seed(1)
    weight, grads = torch.randn(12, 8), [torch.randn(12, 8) for _ in range(2)]
    (plain,), _ = run_steps(Muon, [weight], [[g] for g in grads])
    param = torch.nn.Parameter(distribute_tensor(weight.clone(), one_rank_group, [Shard(0)]))
    optimizer = Muon([param], lr=0.02, weight_decay=0.1)
    for grad in grads:
        param.grad = distribute_tensor(grad.clone(), one_rank_group, [Shard(0)])
        optimizer.step()
    torch.testing.assert_close(param.full_tensor(), plain, rtol=0, atol=0)
