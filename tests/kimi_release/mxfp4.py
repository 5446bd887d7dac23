"""K3's routed experts as the release stores them: compressed-tensors' mxfp4-pack-quantized format (E2M1 codes two
to a byte in `weight_packed`, one E8M0 power-of-two scale per 32 inputs in `weight_scale`), packed and unpacked
by the compressed-tensors library itself, never by a decoder of our own."""
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

FORMAT = "mxfp4-pack-quantized"
GROUP_SIZE = 32
# The magnitudes an E2M1 code can hold.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PACKED_SUFFIXES = ("weight_packed", "weight_scale")

# The K3 release's ignore list, as its config.json writes it. By the regexes alone routed_expert_{down,up}_proj
# would be quantized too, but the release stores them plain: an importer must read the index, not the regexes.
RELEASE_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                  "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


def quantization_config() -> dict:
    """The quantization_config block of K3's text_config."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    group = {"format": FORMAT, "input_activations": None, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": FORMAT, "global_compression_ratio": None,
            "ignore": RELEASE_IGNORE, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}


def scheme_of(block: dict) -> QuantizationScheme:
    """The weights' scheme of a quantization_config block's one config group."""
    if block.get("format") != FORMAT or len(block["config_groups"]) != 1:
        raise ValueError(f"expected one {FORMAT} config group, got format {block.get('format')!r} with groups "
                         f"{sorted(block['config_groups'])}")
    (group,) = block["config_groups"].values()
    return QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))


def compressor():
    return BaseCompressor.get_value_from_registry(FORMAT)


def compress(weight: torch.Tensor, scale: torch.Tensor, block: dict) -> dict[str, torch.Tensor]:
    """weight (out, in) and its float scale (out, in / 32) -> {'weight_packed': uint8 (out, in / 2),
    'weight_scale': uint8 (out, in / 32)}."""
    packed = compressor().compress({"weight": weight, "weight_scale": scale}, scheme_of(block))
    return {name: packed[name] for name in PACKED_SUFFIXES}


def decompress(packed: torch.Tensor, scale: torch.Tensor, block: dict) -> torch.Tensor:
    """The dequantised weight (out, in) of one packed Linear."""
    return compressor().decompress({"weight_packed": packed, "weight_scale": scale}, scheme_of(block))["weight"]


def random_exact_weight(shape: tuple[int, int], exponents: range, generator: torch.Generator):
    """A weight that MXFP4 holds exactly: a random signed E2M1 value times a random power of two per group of 32
    inputs. Returns (weight fp32 (out, in), scale fp32 (out, in / 32))."""
    rows, cols = shape
    if cols % GROUP_SIZE:
        raise ValueError(f"an MXFP4 weight's input width must be a multiple of {GROUP_SIZE}, got {cols}")
    magnitudes = torch.tensor(E2M1_MAGNITUDES)[torch.randint(len(E2M1_MAGNITUDES), shape, generator=generator)]
    signs = torch.randint(2, shape, generator=generator) * 2 - 1
    exponent = torch.randint(exponents.start, exponents.stop, (rows, cols // GROUP_SIZE), generator=generator)
    scale = torch.pow(2.0, exponent.float())  # (out, in / 32)
    return magnitudes * signs * scale.repeat_interleave(GROUP_SIZE, dim=1), scale
