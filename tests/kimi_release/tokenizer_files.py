"""Tiny tokenizers in the forms a release directory carries: Kimi's `tiktoken.model` (base64 token and rank per
line) with a `tokenizer_config.json` naming the special tokens, as the release's tokenization_kimi.py reads them,
or a `tokenizer.json` built with the tokenizers library. Both split text with Kimi's pattern and hold the same
BPE: the 256 bytes (rank = byte value) and a few two-byte merges, then 256 special ids starting at the base
count, laid out like the release (bos at base + 0, eos at base + 2, pad at base + 255, vocab_size = base + 256)."""
import base64
import json
from pathlib import Path

# tokenization_kimi.py's pat_str: the |-join of these eight alternatives (with character-class intersection &&).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MERGES = [b"th", b"he", b"in", b"er", b"an", b"re", b"on", b"at", b"en", b"nd", b"ti", b"es", b"or", b"te", b"of",
          b"ed", b"is", b"it", b"al", b"ar", b"st", b"to", b"nt", b"ng", b"se", b"ha", b"as", b"ou", b"io", b"le",
          b" t", b" a"]
NUM_BASE = 256 + len(MERGES)
NUM_SPECIAL = 256
VOCAB_SIZE = NUM_BASE + NUM_SPECIAL
# Offsets from NUM_BASE of the named special tokens (the rest are <|reserved_token_{id}|>), per release.
SPECIAL_NAMES = {
    "kimi_linear": {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                    5: "<|start_header_id|>", 6: "<|end_header_id|>", 7: "[EOT]", 8: "<|im_system|>",
                    9: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"},
    "kimi_k3": {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
                21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]"},
}
BOS_ID, EOS_ID, PAD_ID = NUM_BASE, NUM_BASE + 2, NUM_BASE + 255


def mergeable_ranks() -> dict[bytes, int]:
    return {**{bytes([byte]): byte for byte in range(256)}, **{merge: 256 + i for i, merge in enumerate(MERGES)}}


def special_tokens(release: str) -> dict[str, int]:
    """All 256 special tokens by name, in id order."""
    names = SPECIAL_NAMES[release]
    ids = range(NUM_BASE, NUM_BASE + NUM_SPECIAL)
    return {names.get(i - NUM_BASE, f"<|reserved_token_{i}|>"): i for i in ids}


def tokenizer_config(release: str) -> dict:
    added = {str(token_id): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True}
             for name, token_id in special_tokens(release).items()}
    names = SPECIAL_NAMES[release]
    return {"added_tokens_decoder": added, "bos_token": names[0], "eos_token": names[2], "pad_token": names[255],
            "unk_token": names[254], "additional_special_tokens": [names[i] for i in sorted(names) if 2 <= i < 254],
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576, "clean_up_tokenization_spaces": False}


def write_tiktoken_files(directory: Path, release: str) -> None:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in mergeable_ranks().items()]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(release), indent=2))


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for code points
    from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def write_tokenizer_json(directory: Path, release: str) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_to_unicode()
    as_text = lambda token: "".join(alphabet[byte] for byte in token)  # noqa: E731
    vocab = {as_text(token): rank for token, rank in mergeable_ranks().items()}
    merges = [(as_text(merge[:1]), as_text(merge[1:])) for merge in MERGES]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special_tokens(release)])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {**tokenizer_config(release), "tokenizer_class": "PreTrainedTokenizerFast"}
    del config["auto_map"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def release_encoding(directory: Path, release: str):
    """The tokenizer the release code builds from tiktoken.model: tiktoken's Encoding with Kimi's pattern and the
    special tokens named in tokenizer_config.json (so the reference's token ids come from tiktoken itself)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(directory / "tiktoken.model"))
    named = {int(i): token["content"] for i, token in
             json.loads((directory / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + NUM_SPECIAL + 2)}
    return tiktoken.Encoding(name=f"kimi-{release}-tiny", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials)
