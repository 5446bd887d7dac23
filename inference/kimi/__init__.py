"""The released Kimi models' format on the inference side: a release's tokenizer (tokenizer.py) and our
checkpoints written in the format (write.py); generate and evaluate read a release directory through
inference/generate.py's open_model_dir. The format itself (config, tensor names, reading) is trainer/kimi/,
which init_from reads too."""
