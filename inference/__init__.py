"""After training: exporting a trained model (native safetensors or the Hugging Face format), generating text
from an export, and evaluating one (lm-evaluation-harness tasks, held-out perplexity). Sits above trainer/:
it reads runs and checkpoints through trainer.trained and trainer.run_dir, and trainer never imports it.
"""
