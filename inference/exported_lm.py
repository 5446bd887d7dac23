"""An export inside lm-evaluation-harness: `ExportedAttnResLM`, registered as lm_eval's model "attnres".

`ExportedAttnResLM.from_export(EXPORT_DIR)`, or, once this module is imported, lm_eval's
`simple_evaluate(model="attnres", model_args="pretrained=EXPORT_DIR,batch_size=8")`, loads the export as
inference.generate does (safetensors and JSON only, checked against its fingerprint and trained context) into
trainer/lm_eval_adapter.py's AttnResLM, the adapter the trainer also runs on its live model.
"""
from __future__ import annotations

from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model

from inference.generate import open_model_dir
from trainer.lm_eval_adapter import AttnResLM


@register_model("attnres")
class ExportedAttnResLM(AttnResLM):
    @classmethod
    def from_export(cls, pretrained: str, batch_size: int = 8, max_length: int | None = None,
                    device: str | None = None, tokenizer: str | None = None) -> ExportedAttnResLM:
        """The export directory `pretrained` (inference.export's native format) or a Kimi release directory;
        `tokenizer` a tokenizer.json to use instead of the directory's own."""
        source = open_model_dir("pretrained", str(pretrained), None, tokenizer)
        return cls(source.load(), source.tokenizer, source.cfg.train.seq_len, batch_size, max_length, device or "auto")

    # lm_eval builds a registered model through these two; both take the export directory as pretrained=.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ExportedAttnResLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> ExportedAttnResLM:
        extra = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls.from_export(**arg_dict, **extra)
