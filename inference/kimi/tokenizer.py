"""A release directory's tokenizer as a `tokenizers.Tokenizer`: its tokenizer.json when it has one, else Kimi's
tiktoken.model (base64 token and rank per line) converted by transformers' TikTokenConverter with the release
code's split pattern, and its special tokens at their exact ids.

The release code (tokenization_kimi.py, never run here) numbers the special tokens from the BPE's size on, 256
reserved plus 2, named by tokenizer_config.json's added_tokens_decoder and `<|reserved_token_{id}|>` where it
names none. The converter appends special tokens at the next free ids, so they are passed in id order, all of
them up to the model's vocab_size (the last two reserved ids lie past it: no embedding row could hold them).
"""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
RESERVED_SPECIAL_TOKENS = 256 + 2
# tokenization_kimi.py's pat_str: CJK runs, words (cased letters, with English contractions), 1-3 digits,
# punctuation runs, newlines and other whitespace; `&&` is character-class intersection (Oniguruma and
# tiktoken's fancy-regex both read it).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class ReleaseTokenizerError(ValueError):
    """A release tokenizer we cannot read exactly; the message is one line."""


def _special_names(directory: Path) -> dict[int, str]:
    """Special token id -> name, from tokenizer_config.json's added_tokens_decoder (JSON only)."""
    config_file = directory / TOKENIZER_CONFIG
    if not config_file.is_file():
        return {}
    try:
        decoder = json.loads(config_file.read_text()).get("added_tokens_decoder") or {}
        return {int(token_id): entry["content"] for token_id, entry in decoder.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ReleaseTokenizerError(f"{config_file} could not be read ({str(error).splitlines()[0]})") from None


def _bpe_size(vocab_file: Path) -> int:
    return sum(1 for line in vocab_file.read_text().splitlines() if line.strip())


def convert_tiktoken(directory: Path, vocab_size: int):
    """tiktoken.model (and tokenizer_config.json's names) -> a tokenizers.Tokenizer with the release's ids."""
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise ReleaseTokenizerError(f"{directory} has only {TIKTOKEN_FILE}; converting it needs transformers and "
                                    "tiktoken (pip install -e '.[kimi]')") from None
    vocab_file = directory / TIKTOKEN_FILE
    base, names = _bpe_size(vocab_file), _special_names(directory)
    special_ids = range(base, min(base + RESERVED_SPECIAL_TOKENS, vocab_size))
    specials = [names.get(token_id, f"<|reserved_token_{token_id}|>") for token_id in special_ids]
    try:
        tokenizer = TikTokenConverter(vocab_file=str(vocab_file), pattern=KIMI_PATTERN,
                                      extra_special_tokens=specials).converted()
    except ValueError as error:  # no tiktoken, or a file it cannot parse
        raise ReleaseTokenizerError(f"{vocab_file} could not be converted ({str(error).splitlines()[0]})") from None
    for token_id, name in zip(special_ids, specials):
        if tokenizer.token_to_id(name) != token_id:
            raise ReleaseTokenizerError(f"{vocab_file}: special token {name!r} came out as id "
                                        f"{tokenizer.token_to_id(name)}, the release gives it {token_id}")
    return tokenizer


def release_tokenizer(directory: Path, vocab_size: int):
    """The release's tokenizer: tokenizer.json, else tiktoken.model converted; None when it ships neither."""
    from tokenizers import Tokenizer

    if (directory / TOKENIZER_FILE).is_file():
        try:
            return Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        except Exception as error:  # tokenizers raises plain Exceptions for unreadable files
            raise ReleaseTokenizerError(f"{directory / TOKENIZER_FILE} could not be read "
                                        f"({str(error).splitlines()[0]})") from None
    if (directory / TIKTOKEN_FILE).is_file():
        return convert_tiktoken(directory, vocab_size)
    return None
