"""Depth attention ops for AttnRes (reference implementation)."""
from kernels.attnres.reference import (depth_attention, depth_scores, inverse_rms, merge, phase1,
                                       source_weights, weighted_sum)

__all__ = ["depth_attention", "depth_scores", "inverse_rms", "merge", "phase1", "source_weights", "weighted_sum"]
