"""The parameters of one AttnRes depth read (one per sublayer, plus the final read)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.attnres import source_weights
from model.config import ResidualConfig
from model.norms import RMSNorm


class DepthRead(nn.Module):
    """Pseudo-query and key norm of one sublayer's depth attention (or static mixing scalars).

    Every parameter is initialised so the first read is the uniform average of its sources: the
    query is zero (paper: "all pseudo-query vectors must be initialized to zero"). `mixing=scalars`
    (DenseFormer) weighs its sources with raw learned scalars, initialised to 1: the first read is
    the baseline's sum itself.
    """

    def __init__(self, d_model: int, options: ResidualConfig, n_sources: int, eps: float):
        super().__init__()
        self.heads = options.heads
        if options.mixing == "static":
            self.logits = nn.Parameter(torch.empty(n_sources))
            return
        if options.mixing == "scalars":
            self.scalars = nn.Parameter(torch.empty(n_sources))
            return
        if options.query == "learned":
            self.query = nn.Parameter(torch.empty(d_model))
        else:
            # Input-dependent ablation: q = W RMSNorm(latest source) / d; W zero so step 0 is still uniform.
            # Under Adam every entry of W moves by about the learning rate per step, so W x moves ~d times
            # faster than a learned query does; dividing by the fan-in d gives the query the learned one's
            # pace. Unscaled, model=s diverged by step 20 of the ablation (gradient norm 7e5); divided by
            # sqrt(d) (self-attention's scale) its gradient norm still spiked to 2.7e3 with the loss 0.27
            # behind Full at step 50; divided by d it tracks Full (6.05 against 6.02 at step 50).
            self.query_norm = RMSNorm(d_model, eps)
            self.query_proj = nn.Linear(d_model, d_model, bias=False)
        self.key_norm = RMSNorm(d_model, eps) if options.key_norm else None

    def init_weights(self, stds) -> None:
        """Zero whatever sets the mixing weights, whatever the scheme (the norms initialise themselves)."""
        for name in ("logits", "query"):
            if hasattr(self, name):
                nn.init.zeros_(getattr(self, name))
        if hasattr(self, "query_proj"):
            nn.init.zeros_(self.query_proj.weight)
        if hasattr(self, "scalars"):
            nn.init.ones_(self.scalars)

    @property
    def is_static(self) -> bool:
        return hasattr(self, "logits") or hasattr(self, "scalars")

    def static_weights(self, kernel: str) -> torch.Tensor:
        """(N,) input-independent source weights."""
        return self.scalars if hasattr(self, "scalars") else source_weights(self.logits, kernel)

    def _fold_gain(self, query: torch.Tensor) -> torch.Tensor:
        # RMSNorm(k) * g . w == rmsnorm(k) . (g * w): the gain moves onto the query.
        return query if self.key_norm is None else query * self.key_norm.weight

    def learned_query(self) -> torch.Tensor:
        """(H, d/H) query with the key-norm gain folded in."""
        return self._fold_gain(self.query).unflatten(-1, (self.heads, -1))

    def token_query(self, latest: torch.Tensor) -> torch.Tensor:
        """(B, T, H, d/H) input-dependent query projected from the latest source."""
        query = self.query_proj(self.query_norm(latest)) / latest.shape[-1]
        return self._fold_gain(query).unflatten(-1, (self.heads, -1))

    def query_for(self, latest: torch.Tensor) -> torch.Tensor:
        return self.learned_query() if hasattr(self, "query") else self.token_query(latest)
