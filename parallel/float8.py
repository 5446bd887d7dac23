"""Float8 matmuls, `train.float8=true`: torchao's float8 training conversion, applied at build time.

`convert_to_float8` swaps the Linear layers of every block's token mixer (`attn`: KDA or MLA) and MLP
(`mlp`: the dense gated MLP, or the MoE's shared experts and LatentMoE's projections) for torchao's
`Float8Linear`, on the meta model, before activation checkpointing, tp/ep and FSDP wrap them (as
torchtitan's model converters do, so FSDP2 could later gather float8 weights). Parameter names do not
change, so checkpoints move freely between float8 and bf16 runs. Recipe: torchao's default, tensorwise
dynamic scales, e4m3 for inputs and weights, e5m2 for output gradients; the weights stay in their fp32
master copy and each matmul casts its operands (so the saved activations are the high-precision inputs a
plain Linear keeps).

Kept in higher precision, on purpose:
- the routers (`mlp.router`): a rounding step in the logits flips which experts a token picks, and their
  matmul is (d_model x n_experts), too small to gain;
- AttnRes's depth read (`attn_res` / `mlp_res`, model/residual): its softmax over depth compares a handful of
  logits per token, where e4m3's 3 mantissa bits would blur the weighting; it is not a big matmul either;
- embedding, norms and lm_head (the last: the loss is most sensitive to its logits, torchtitan keeps it too);
- the routed experts (MoE w_gate / w_up / w_down, grouped GEMM or loop): torchao's float8 MoE path
  (prototype.moe_training) intercepts torch._grouped_mm only with the expert weight as a column-major
  (E, K, N) operand, i.e. stored (E, N, K) and transposed at the call, and only through its CUDA Triton
  kernels and torch._scaled_grouped_mm (no emulation); ours are stored row-major (E, d, inter).
- Linears whose dims are not multiples of 16 per tp rank (KDA's b_proj: one output per head, MLA's
  kv_a_proj: latent + rope width): torch._scaled_mm's alignment rule.

Off CUDA, torchao emulates the float8 matmul (`Float8LinearConfig(emulate=True)`): operands are rounded to
float8 exactly as on the GPU, then multiplied in fp32. So a CPU run tests the numerics, not the speed.
"""
from __future__ import annotations

from torch import nn

# torchao 0.18 is the release this was checked against: its compiled parts target torch >= 2.11, and its
# Python float8 training path (all we use) runs on 2.11-2.15. Kept in step with setup.py.
TORCHAO_SPEC = "torchao>=0.18,<0.19"
FLOAT8_SUBLAYERS = ("attn", "mlp")  # a transformer block's token mixer and its MLP (layers.<i>.<sublayer>.…)
HIGH_PRECISION = ("router",)        # see the module docstring
ALIGNMENT = 16                      # torch._scaled_mm: both dims of the weight a multiple of 16


def runs_in_float8(fqn: str, linear: nn.Linear, tp: int = 1) -> bool:
    """Whether the Linear at `fqn` (a name in the Decoder) is converted; `tp` slices its dims first."""
    parts = fqn.split(".")
    if len(parts) < 3 or parts[0] != "layers" or parts[2] not in FLOAT8_SUBLAYERS:
        return False
    if any(part in HIGH_PRECISION for part in parts):
        return False
    return linear.in_features % (ALIGNMENT * tp) == 0 and linear.out_features % (ALIGNMENT * tp) == 0


def float8_linear_names(model: nn.Module, tp: int = 1) -> list[str]:
    """The Linear layers `convert_to_float8` converts, by qualified name (the planner counts their weights)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and runs_in_float8(name, module, tp)]


def float8_refusal(cuda_capability: tuple[int, int] | None) -> str | None:
    """Why train.float8=true cannot run here (None when it can): torchao missing, or a GPU without float8
    tensor cores. No GPU (`cuda_capability` None): torchao's emulation, which runs anywhere."""
    try:
        import torchao.float8  # noqa: F401  (the check is the import)
    except ImportError as error:
        return f"train.float8=true needs torchao ({error}); install '{TORCHAO_SPEC}' or set train.float8=false"
    if cuda_capability is not None and cuda_capability < (8, 9):
        major, minor = cuda_capability
        return (f"train.float8=true needs float8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"this GPU is sm{major}{minor}: set train.float8=false")
    return None


def convert_to_float8(model: nn.Module, *, tp: int = 1, emulate: bool = False) -> list[str]:
    """Swap the selected Linear layers of `model` (meta or real) for torchao's Float8Linear in place;
    returns their names. `emulate`: fp32 matmuls on float8-rounded operands (no float8 hardware)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = float8_linear_names(model, tp)
    chosen = set(names)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    return names
