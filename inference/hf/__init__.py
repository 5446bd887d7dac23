"""The Hugging Face transformers face of a trained model: `inference.export format=hf` writes these classes,
with the model and reference kernels they run flattened beside them (bundle.py), so that
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` needs neither this package nor Triton."""
