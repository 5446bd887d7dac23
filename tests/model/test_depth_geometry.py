"""DepthGeometry against a direct enumeration of which sublayers each depth block sums."""
import math

import pytest

from model.residual import DepthGeometry
from trainer.config import load_config


def depth_blocks(L: int, S: int) -> list[list[int]]:
    """Sublayers 1..L cut into depth blocks of S (the last may be shorter)."""
    return [list(range(start, min(start + S, L + 1))) for start in range(1, L + 1, S)]


def sources_seen(L: int, S: int, sublayer: int, window: int | None) -> int:
    """b_0, every depth block that holds an earlier sublayer (complete or partial), the window applied."""
    touched = sum(1 for block in depth_blocks(L, S) if block[0] < sublayer)
    n = 1 + touched
    return n if window is None else min(n, 1 + window)


@pytest.mark.parametrize("L, S", [(16, 1), (16, 2), (16, 4), (16, 16), (14, 4), (10, 3), (6, 7)])
@pytest.mark.parametrize("window", [None, 2])
def test_sources_and_completed_blocks_match_the_enumeration(L, S, window):
    geometry = DepthGeometry(L, S, two_phase=window is None, window=window)
    blocks = depth_blocks(L, S)
    for sublayer in range(1, L + 2):
        assert geometry.n_sources(sublayer) == sources_seen(L, S, sublayer, window), sublayer
    for done in range(L + 1):
        full = [block for block in blocks if len(block) == S and block[-1] <= done]
        assert geometry.blocks_done(done) == 1 + len(full)
        current = next((b for b in blocks if done in b), None)  # the depth block sublayer `done` wrote to
        assert geometry.partial_open(done) == (current is not None and not (done == current[-1] and len(current) == S))
    for sublayer in range(1, L + 1):
        block = next(b for b in blocks if sublayer in b)
        assert geometry.position(sublayer) == block.index(sublayer)
        assert geometry.depth_block_end(sublayer) == block[-1]
        assert geometry.closes_depth_block(sublayer) == (sublayer == block[-1] and len(block) == S)
    assert geometry.max_sources == 1 + len(blocks)
    if window is None:
        assert geometry.n_sources(L + 1) == geometry.max_sources

@pytest.mark.parametrize("L, S, two_phase", [(16, 4, True), (16, 6, True), (16, 4, False), (14, 14, True),
                                             (16, 1, True)])
def test_units_never_cut_a_two_phase_depth_block_and_cut_wherever_they_may(L, S, two_phase):
    geometry = DepthGeometry(L, S, two_phase, None)
    transformer_blocks = list(range(L // 2))
    units = geometry.units(transformer_blocks)
    assert [b for unit in units for b in unit] == transformer_blocks
    for unit in units[:-1]:
        last_sublayer = 2 * unit[-1] + 2
        assert not two_phase or last_sublayer % S == 0  # no depth block straddles two units
    if not two_phase:
        assert units == [[b] for b in transformer_blocks]
    for unit in units:  # maximal cutting: no allowed cut point is left inside a unit
        assert all(not geometry.unit_may_end_after(b) for b in unit[:-1])


def test_units_on_a_pipeline_chunk_start_at_its_first_block():
    geometry = DepthGeometry(16, 4, True, None)
    assert geometry.units([3, 4, 5]) == [[3], [4, 5]]  # sublayer 8 ends depth block 2; 12 would end 3


@pytest.mark.parametrize("variant, size", [("baseline", None), ("x0", None), ("mhc", None), ("full", 1),
                                           ("block", 2)])
def test_built_from_the_config(variant, size):
    cfg = load_config(["model=s", f"variant={variant}"]).model
    geometry = DepthGeometry.of(cfg)
    assert (geometry.size, geometry.attends, geometry.n_sublayers) == (size, size is not None, cfg.n_sublayers)
    if size is None:
        with pytest.raises(ValueError, match="no depth blocks"):
            geometry.blocks_done(3)
        assert geometry.units([0, 1, 2]) == [[0], [1], [2]]


def test_block_default_is_about_eight_depth_blocks_and_an_explicit_size_wins():
    cfg = load_config(["model=m", "variant=block"]).model
    assert DepthGeometry.of(cfg).max_sources - 1 == math.ceil(cfg.n_sublayers / round(cfg.n_sublayers / 8))
    cfg = load_config(["model=s", "variant=block", "variant.block_size=4"]).model
    assert DepthGeometry.of(cfg).size == 4
