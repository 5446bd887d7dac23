"""The one table between the released Kimi models' tensor names and ours, with the transform each needs; import
(trainer/kimi/load.py) and export (inference/kimi/write.py) both read it.

A release name carries the layout's prefix (K3's `language_model.`, none for Kimi Linear) before the names
below. `{i}` is a layer (our block index, the release's 0-based layer), `{e}` a routed expert.

Transforms (import direction; export is the inverse):
  same      the tensor as it is
  experts   our (E, d, I) / (E, I, d) stack from E release Linears [out, in]: each transposed, then stacked
  a_log     our (H,) from Kimi Linear's [1, 1, H, 1] or K3's [n >= H], whose entries past the first H (one
            per head) must be zero; export writes Kimi Linear's shape, or K3's padded to head_dim
  query     our pseudo-query (d,) from the release's Linear(d -> 1) weight [1, d]
  absent    ours has it, the release has none: import sets zeros (the release's function); export refuses a
            nonzero one, which the format cannot hold (our KDA output gate's bias)
  unused    the release has it and never reads it (K3's layer-0 attention read: nothing is banked before
            layer 0, so it mixes one source). Import keeps ours (the initial zero query and unit norm, which
            read the same); export writes ours as the release shapes it
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from trainer.kimi.config import KIMI_K3, ReleaseConfig

SAME, EXPERTS, A_LOG, QUERY, ABSENT, UNUSED = "same", "experts", "a_log", "query", "absent", "unused"


@dataclass(frozen=True)
class Entry:
    ours: str                 # our state-dict name, with {i}
    release: str | None       # the release's name (after the layout prefix), with {i} and {e}; None: absent
    transform: str = SAME


_LAYER = "model.layers.{i}."
_MOE = _LAYER + "block_sparse_moe."
TABLE = (
    Entry("embed.weight", "model.embed_tokens.weight"),
    Entry("norm.weight", "model.norm.weight"),
    Entry("lm_head.weight", "lm_head.weight"),
    Entry("final_res.query", "model.output_attn_res_proj.weight", QUERY),
    Entry("final_res.key_norm.weight", "model.output_attn_res_norm.weight"),
    Entry("layers.{i}.attn_norm.weight", _LAYER + "input_layernorm.weight"),
    Entry("layers.{i}.mlp_norm.weight", _LAYER + "post_attention_layernorm.weight"),
    # AttnRes reads: layer 0's attention read is K3's unused one.
    Entry("layers.0.attn_res.query", "model.layers.0.self_attention_res_proj.weight", UNUSED),
    Entry("layers.0.attn_res.key_norm.weight", "model.layers.0.self_attention_res_norm.weight", UNUSED),
    Entry("layers.{i}.attn_res.query", _LAYER + "self_attention_res_proj.weight", QUERY),
    Entry("layers.{i}.attn_res.key_norm.weight", _LAYER + "self_attention_res_norm.weight"),
    Entry("layers.{i}.mlp_res.query", _LAYER + "mlp_res_proj.weight", QUERY),
    Entry("layers.{i}.mlp_res.key_norm.weight", _LAYER + "mlp_res_norm.weight"),
    # KDA (q/k/v/o projections share their names with MLA's q_proj and o_proj).
    *(Entry(f"layers.{{i}}.attn.{name}", _LAYER + f"self_attn.{name}")
      for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_conv1d.weight",
                   "k_conv1d.weight", "v_conv1d.weight", "b_proj.weight", "o_norm.weight", "dt_bias")),
    Entry("layers.{i}.attn.f_proj.0.weight", _LAYER + "self_attn.f_a_proj.weight"),
    Entry("layers.{i}.attn.f_proj.1.weight", _LAYER + "self_attn.f_b_proj.weight"),
    Entry("layers.{i}.attn.g_proj.0.weight", _LAYER + "self_attn.g_a_proj.weight"),
    Entry("layers.{i}.attn.g_proj.1.weight", _LAYER + "self_attn.g_b_proj.weight"),
    Entry("layers.{i}.attn.g_proj.1.bias", None, ABSENT),
    # K3's full-rank KDA output gate and MLA's output gate share the release's name.
    Entry("layers.{i}.attn.g_proj.weight", _LAYER + "self_attn.g_proj.weight"),
    Entry("layers.{i}.attn.g_proj.bias", None, ABSENT),
    Entry("layers.{i}.attn.A_log", _LAYER + "self_attn.A_log", A_LOG),
    # MLA (K3's query LoRA: q_a_proj, q_a_layernorm, q_b_proj)
    *(Entry(f"layers.{{i}}.attn.{name}.weight", _LAYER + f"self_attn.{name}.weight")
      for name in ("q_a_proj", "q_a_layernorm", "q_b_proj")),
    Entry("layers.{i}.attn.kv_a_proj.weight", _LAYER + "self_attn.kv_a_proj_with_mqa.weight"),
    Entry("layers.{i}.attn.kv_a_norm.weight", _LAYER + "self_attn.kv_a_layernorm.weight"),
    Entry("layers.{i}.attn.kv_b_proj.weight", _LAYER + "self_attn.kv_b_proj.weight"),
    # Dense MLP (the first first_k_dense_replace layers)
    *(Entry(f"layers.{{i}}.mlp.{name}.weight", _LAYER + f"mlp.{name}.weight")
      for name in ("gate_proj", "up_proj", "down_proj")),
    # MoE: router, score-correction bias (our expert_bias buffer), routed experts, shared experts.
    Entry("layers.{i}.mlp.router.weight", _MOE + "gate.weight"),
    Entry("layers.{i}.mlp.expert_bias", _MOE + "gate.e_score_correction_bias"),
    Entry("layers.{i}.mlp.w_gate", _MOE + "experts.{e}.w1.weight", EXPERTS),
    Entry("layers.{i}.mlp.w_up", _MOE + "experts.{e}.w3.weight", EXPERTS),
    Entry("layers.{i}.mlp.w_down", _MOE + "experts.{e}.w2.weight", EXPERTS),
    *(Entry(f"layers.{{i}}.mlp.shared.{name}.weight", _MOE + f"shared_experts.{name}.weight")
      for name in ("gate_proj", "up_proj", "down_proj")),
    # K3's LatentMoE
    *(Entry(f"layers.{{i}}.mlp.{name}.weight", _MOE + f"{name}.weight")
      for name in ("routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj")),
)
# Release tensors no decoder reads: K3's vision tower and projector.
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")


class NameTableError(ValueError):
    """Tensors that do not map, or values the release format cannot hold; the message is one line."""


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)"))


_PATTERNS = [(_pattern(entry.ours), entry) for entry in TABLE]


@dataclass(frozen=True)
class Mapped:
    """One of our tensors and the release tensors that hold it."""
    ours: str
    entry: Entry
    release: tuple[str, ...]   # full release names (prefix included); one per expert for EXPERTS

    @property
    def transform(self) -> str:
        return self.entry.transform


def map_name(ours: str, shape: torch.Size, release: ReleaseConfig) -> Mapped:
    """Our state-dict name (of `shape`) -> its release tensors, by the first TABLE entry that matches."""
    for pattern, entry in _PATTERNS:
        match = pattern.fullmatch(ours)
        if match is None:
            continue
        if entry.release is None:
            return Mapped(ours, entry, ())
        name = release.prefix + entry.release.format(i=match.groupdict().get("i"), e="{e}")
        names = tuple(name.format(e=e) for e in range(shape[0])) if entry.transform == EXPERTS else (name,)
        return Mapped(ours, entry, names)
    raise NameTableError(f"our tensor {ours} has no entry in the Kimi name table (trainer/kimi/names.py)")


def to_ours(mapped: Mapped, tensors: list[torch.Tensor], shape: torch.Size, source: str) -> torch.Tensor | None:
    """The release's tensors of `mapped` -> ours, of `shape` (None: keep ours, for an unused one)."""
    transform = mapped.transform
    if transform == UNUSED:
        return None
    if transform == ABSENT:
        return torch.zeros(shape)
    if transform == EXPERTS:
        return torch.stack([tensor.T for tensor in tensors])  # (E, in, out)
    tensor = tensors[0]
    if transform == A_LOG:
        flat = tensor.reshape(-1)  # (n,)
        heads = shape[0]
        if flat.numel() < heads or flat[heads:].any():
            raise NameTableError(f"{source}: {mapped.release[0]} holds {flat.numel()} entries for {heads} heads, "
                                 "and only a zero tail past one per head can be read as per-head A_log")
        return flat[:heads]
    if transform == QUERY:
        return tensor.reshape(-1)  # (d,)
    return tensor


def to_release(mapped: Mapped, tensor: torch.Tensor, release: ReleaseConfig) -> list[tuple[str, torch.Tensor]]:
    """Our tensor -> (release name, tensor) pairs; a value the format cannot hold is refused in one line."""
    transform = mapped.transform
    if transform == ABSENT:
        if tensor.any():
            raise NameTableError(f"{mapped.ours} is nonzero, and the Kimi format has no such tensor (its KDA output "
                                 "gate has no bias); a model whose gate bias trained cannot be exported exactly")
        return []
    if transform == EXPERTS:
        return [(name, tensor[e].T.contiguous()) for e, name in enumerate(mapped.release)]
    name = mapped.release[0]
    if transform in (QUERY, UNUSED) and mapped.ours.endswith(".query"):
        return [(name, tensor.reshape(1, -1))]  # (1, d): Linear(d -> 1)
    if transform == A_LOG:
        heads = tensor.shape[0]
        if release.layout != KIMI_K3:
            return [(name, tensor.reshape(1, 1, heads, 1))]
        padded = tensor.new_zeros(max(heads, release.model.kda.head_dim))
        padded[:heads] = tensor
        return [(name, padded)]
    return [(name, tensor)]
