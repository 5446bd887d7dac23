"""Context parallelism's MLA balance (parallel/context.py): the 2cp chunks of a sequence are each scored by
one rank, and every rank does the same causal attention work, where the contiguous split gives the last rank
(2cp - 1)/cp of the mean. The exchange itself runs in the parity worker (tests/parallel/tp_parity_worker.py)."""
import pytest

from parallel.context import ContextSplit


def causal_work(chunks) -> float:
    """Query-key pairs scored, in chunk-by-chunk units: chunk c's queries see c whole chunks and half their own."""
    return sum(chunk + 0.5 for chunk in chunks)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_every_chunk_is_scored_once_and_every_rank_does_the_same_work(size):
    splits = [ContextSplit(None, rank, size) for rank in range(size)]
    assert sorted(chunk for split in splits for chunk in split.scored_chunks()) == list(range(2 * size))
    balanced = [causal_work(split.scored_chunks()) for split in splits]
    assert balanced == [balanced[0]] * size
    contiguous = [causal_work((2 * rank, 2 * rank + 1)) for rank in range(size)]
    assert max(contiguous) / (sum(contiguous) / size) == pytest.approx((2 * size - 1) / size)


def test_scored_pieces_are_the_chunks_positions_in_the_sequence():
    """A slice of 8 tokens on rank 1 of 4: chunks 1 and 6 of 4 tokens each."""
    assert ContextSplit(None, 1, 4).scored_pieces(8) == [(4, 4), (24, 4)]
