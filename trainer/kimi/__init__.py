"""The released Kimi models' format (Kimi Linear, Kimi K3): their config.json onto our ModelConfig and back
(config.py), the one table between their tensor names and ours (names.py), their safetensors read tensor by tensor
(files.py, packed MXFP4 experts through compressed-tensors: quantized.py), and a release read into our model
(load.py). Here, under trainer/ rather than inference/, because training starts from a release too (init_from); the export that
writes the format is inference/kimi/.
"""
