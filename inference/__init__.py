"""After training: exporting a trained model (native safetensors, the Hugging Face format, or the released Kimi
models' format), generating text from an export or a Kimi release, and evaluating one (lm-evaluation-harness
tasks, held-out perplexity). Sits above trainer/: it reads runs and checkpoints through trainer.trained and
trainer.run_dir, and trainer never imports it.

`load_model(DIR)` (inference/load.py) is the entry point for notebooks: (model, tokenizer) of a Kimi release
directory or one of our exports.
"""


def load_model(directory):
    """(model, tokenizer) of a Kimi release directory or an export; see inference/load.py."""
    from inference.load import load_model as load

    return load(directory)
