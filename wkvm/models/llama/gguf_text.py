"""The tokenizer and chat template a GGUF file carries in its metadata.

`gguf_tokenizer` rebuilds the byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3) as an HF
`tokenizers` Tokenizer from `tokenizer.ggml.tokens` / `merges` / `token_type`; control tokens become special added
tokens so chat markers encode as one id. The pre-tokenizer follows `tokenizer.ggml.pre`, as llama.cpp's
`llama-vocab.cpp` maps it; SentencePiece vocabularies (`"llama"`, Llama 2) are refused.
"""

from __future__ import annotations

import os

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizers

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import CheckpointError
from wkvm.models.llama.gguf_file import field, open_reader
from wkvm.tokenizer import HFTokenizer

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGITS_FIRST = ("smollm", "starcoder", "refact")  # llama.cpp: "\p{N}" then the GPT-2 split
GPT2 = ("default", "gpt-2", "gpt2")
LLAMA3 = ("llama-bpe", "llama3")


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in DIGITS_FIRST:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in LLAMA3:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    known = ", ".join(DIGITS_FIRST + GPT2 + LLAMA3)
    raise CheckpointError(f"GGUF tokenizer.ggml.pre {pre!r} is not one wkvm rebuilds (known: {known})")


class GGUFTokenizer(HFTokenizer):
    """An HFTokenizer over a `tokenizers` object built in memory rather than read from tokenizer.json."""

    def __init__(self, tok: HFTokenizers, eos_token_id: int | None, more_eos: frozenset[int] = frozenset(),
                 bos_token_id: int | None = None, add_bos: bool = False):  # fmt: skip
        self._tok = tok  # no file to read: super's __init__ is not run
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.set_specials(eos_token_id, more_eos, bos_token_id, add_bos)


def gguf_tokenizer(path: str | os.PathLike[str]) -> GGUFTokenizer:
    reader = open_reader(path)
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', is)")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = field(reader, "tokenizer.ggml.merges") or []
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    pairs = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    pre = field(reader, "tokenizer.ggml.pre") or "default"
    # Llama 3's vocabulary takes a piece that is itself a token whole, before any merge (llama.cpp's ignore_merges for
    # llama-bpe; HF's tokenizer.json says "ignore_merges": true)
    tok = HFTokenizers(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False,
                                  ignore_merges=pre in LLAMA3))  # fmt: skip
    try:
        tok.pre_tokenizer = pre_tokenizer(pre)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    tok.decoder = decoders.ByteLevel()
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in kinds if k == TokenType.USER_DEFINED])
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp also ends generation at the end-of-turn and end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>)
    ends = (field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom"))
    # BOS first in a prompt: as the file says, else llama.cpp's default for the vocabulary (Llama 3's adds it)
    bos, add_bos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.add_bos_token")
    return GGUFTokenizer(tok, None if eos is None else int(eos), frozenset(int(i) for i in ends if i is not None),
                         None if bos is None else int(bos), bool(add_bos) if add_bos is not None else pre in LLAMA3)


def gguf_chat_template(path: str | os.PathLike[str]) -> ChatTemplate | None:
    """`tokenizer.chat_template` with the EOS token's text as its stop string; None when the file has none."""
    reader = open_reader(path)
    source = field(reader, "tokenizer.chat_template")
    if not isinstance(source, str):
        return None
    eos, tokens = field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.tokens")
    stop = [str(tokens[int(eos)])] if eos is not None and tokens else []
    return ChatTemplate(source, stop, "GGUF tokenizer.chat_template")
