"""DepthState.carry / from_carry: the one serialisation a pipeline cut and a checkpointed block share."""
import pytest
import torch

from model.residual import CarryLayout, DepthState


def tensors(n: int) -> list[torch.Tensor]:
    return [torch.full((2, 3, 4), float(i)) for i in range(n)]


def test_a_carried_state_comes_back_field_by_field_with_the_same_tensors():
    b0, b1, partial, r0, r1, o, m, l = tensors(8)
    state = DepthState(blocks=[b0, b1], partial=partial, next_sublayer=5, block_inv_rms=[r0, r1],
                       phase1={7: (o, m, l, None), 6: (m, o)})
    carried, layout = state.carry()
    # partial, blocks, key norms, then phase-1 entries by sublayer; the None slot sends no tensor.
    assert [t is u for t, u in zip(carried, (partial, b0, b1, r0, r1, m, o, o, m, l))] == [True] * 10
    assert len(carried) == 10 and layout.phase1 == ((6, 2), (7, 4)) and layout.present[-1] is False
    back = DepthState.from_carry(carried, layout, next_sublayer=5)
    assert back.partial is partial and back.blocks == [b0, b1] and back.block_inv_rms == [r0, r1]
    assert back.phase1 == {6: (m, o), 7: (o, m, l, None)} and back.next_sublayer == 5
    assert all(t is u for t, u in zip(back.blocks + back.block_inv_rms, (b0, b1, r0, r1)))


def test_a_state_without_a_partial_sum_carries_only_its_blocks():
    b0, b1 = tensors(2)
    carried, layout = DepthState(blocks=[b0, b1], partial=None).carry()
    assert carried == (b0, b1) and layout == CarryLayout.of_message(False, 2)
    back = DepthState.from_carry(carried, layout)
    assert back.partial is None and back.blocks == [b0, b1] and back.phase1 == {}


def test_a_pending_write_is_refused_at_the_boundary_not_dropped():
    b0, partial = tensors(2)
    state = DepthState(blocks=[b0], partial=partial, next_sublayer=3, pending_write=(partial,))
    with pytest.raises(RuntimeError, match="sublayer 3: a pending write cannot cross a block boundary"):
        state.carry()
