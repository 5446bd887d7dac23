"""An independent fp32 reference of the released Kimi text models (Kimi Linear, Kimi K3) and writers of tiny
checkpoints in their release layouts. Written from the release semantics, never from model/, so that it can
catch our import's mistakes: it imports only torch, safetensors, compressed-tensors and tokenizers/tiktoken."""
