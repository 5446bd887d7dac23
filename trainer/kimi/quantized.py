"""Dequantising a release's compressed Linear weights (K3's routed experts: compressed-tensors'
`mxfp4-pack-quantized`, E2M1 codes two to a byte and one E8M0 scale per 32 inputs) through the
compressed-tensors library's own compressor for the format the config names, never a decoder of our own.
Imported only for a checkpoint that holds packed weights (the library is the `kimi` extra)."""
from __future__ import annotations

import torch


class QuantizedWeightError(ValueError):
    """A packed weight we cannot dequantise; the message is one line."""


def _scheme(quantization: dict | None, where: str):
    """(the compressor class, the weights' QuantizationScheme) of a quantization_config with one config group."""
    try:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    except ImportError:
        raise QuantizedWeightError(f"{where} is stored packed (compressed-tensors); install the library with "
                                   "pip install -e '.[kimi]'") from None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "compressed-tensors":
        raise QuantizedWeightError(f"{where} is stored packed, but config.json has no compressed-tensors "
                                   "quantization_config to read it with")
    groups = quantization.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizedWeightError(f"{where}: quantization_config has {len(groups)} config groups; this importer "
                                   "reads checkpoints with exactly one (as K3's)")
    (group,) = groups.values()
    form = group.get("format") or quantization.get("format")
    try:
        compressor = BaseCompressor.get_value_from_registry(form)
        scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    except (KeyError, ValueError, TypeError) as error:
        raise QuantizedWeightError(f"{where}: quantization format {form!r} cannot be read by compressed-tensors "
                                   f"({str(error).splitlines()[0]})") from None
    return compressor, scheme


def dequantise(packed: dict[str, torch.Tensor], quantization: dict | None, where: str) -> torch.Tensor:
    """{'weight_packed', 'weight_scale'} of one Linear -> its weight (out, in), as compressed-tensors
    decompresses it."""
    compressor, scheme = _scheme(quantization, where)
    return compressor.decompress(dict(packed), scheme)["weight"]
