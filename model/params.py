"""Parameter counts: total, and activated per token (routed experts count top_k / E)."""
from __future__ import annotations

from torch import nn

from model.moe import MoE


def count_parameters(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoE):
            routed = sum(p.numel() for name, p in module.named_parameters(recurse=False) if name.startswith("w_"))
            inactive += routed - routed * module.top_k // module.n_experts
    return {"total": total, "active": total - inactive}
