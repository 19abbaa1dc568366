"""The tokenizer and chat template a GGUF file carries in its metadata.

`gguf_tokenizer` rebuilds the vocabulary as an HF `tokenizers` Tokenizer that encodes as llama.cpp's `llama-vocab.cpp`
does, for the two kinds a `llama` GGUF carries:
- byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3) from `tokens` / `merges` / `token_type`,
  the pre-tokenizer following `tokenizer.ggml.pre`;
- SentencePiece (`"llama"`: Llama 2, TinyLlama, Mistral 7B) from `tokens` / `scores` / `token_type`: llama.cpp's
  tokenizer merges the adjacent pair whose joined text is the best-scoring token, again and again, and spells
  characters outside the vocabulary as byte tokens `<0xNN>`; a BPE whose merges are every (left, right) split of a
  token, ranked by the token's score, with byte fallback, does the same. Spaces are `▁`, and one is put before the
  text and after every special token (`tokenizer.ggml.add_space_prefix`, default true), as llama.cpp does.
Control tokens become special added tokens, so chat markers encode as one id; user-defined ones plain added tokens.
"""

from __future__ import annotations

import os
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizers

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import CheckpointError
from wkvm.models.llama.gguf_file import field, open_reader
from wkvm.tokenizer import HFTokenizer

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokens llama.cpp ends generation at whatever the file names as EOS (llama-vocab.cpp's end-of-generation texts, those
# of the vocabularies a llama GGUF carries): a Llama 3 base model's file names <|end_of_text|> only, but its chats end
# with <|eot_id|>
END_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>"})  # fmt: skip
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
    if model not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', and "
                              "SentencePiece, 'llama', are)")  # fmt: skip
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    pre = field(reader, "tokenizer.ggml.pre") or "default"
    try:
        tok = sentencepiece(reader, tokens, types) if model == "llama" else byte_level_bpe(reader, tokens, pre)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    kinds = list(zip(tokens, types, strict=True))
    special = (TokenType.CONTROL, TokenType.UNKNOWN) if model == "llama" else (TokenType.CONTROL,)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k in special])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in kinds if k == TokenType.USER_DEFINED])
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp also ends generation at the end-of-turn and end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>),
    # named in the file or found by their text
    named = (field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom"))
    ends = [*named, *(i for i, t in enumerate(tokens) if t in END_TEXTS)]
    # BOS first in a prompt: as the file says, else llama.cpp's default for the vocabulary (SentencePiece's and Llama
    # 3's add it)
    bos, add_bos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.add_bos_token")
    default_bos = model == "llama" or pre in LLAMA3
    return GGUFTokenizer(tok, None if eos is None else int(eos), frozenset(int(i) for i in ends if i is not None),
                         None if bos is None else int(bos), bool(add_bos) if add_bos is not None else default_bos)


def byte_level_bpe(reader: Any, tokens: list[str], pre: str) -> HFTokenizers:
    merges: list[str] = field(reader, "tokenizer.ggml.merges") or []
    pairs = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    # Llama 3's vocabulary takes a piece that is itself a token whole, before any merge (llama.cpp's ignore_merges for
    # llama-bpe; HF's tokenizer.json says "ignore_merges": true)
    tok = HFTokenizers(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False,
                                  ignore_merges=pre in LLAMA3))  # fmt: skip
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece(reader: Any, tokens: list[str], types: list[int]) -> HFTokenizers:
    """llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`) as a BPE: every split of a token into two tokens is a
    merge, ranked by the joined token's score (best first); characters no token holds fall back to byte tokens."""
    scores: list[float] | None = field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError("a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []  # (-score, id, split): the best-scoring token first; ties in file order, as llama.cpp scans left first
    for i, (t, score) in enumerate(zip(tokens, scores, strict=True)):
        if types[i] == TokenType.BYTE:
            continue
        ranked += [(-score, i, j) for j in range(1, len(t)) if t[:j] in ids and t[j:] in ids]
    ranked.sort()
    merges = [(tokens[i][:j], tokens[i][j:]) for _, i, j in ranked]
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    tok = HFTokenizers(models.BPE(vocab=ids, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = field(reader, "tokenizer.ggml.add_space_prefix")
    spaces: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
    # HF runs the normalizer on each stretch of text between added tokens: Prepend then puts a ▁ at the start and after
    # every special token, where llama.cpp puts its prefix space
    if prefix is None or bool(prefix):
        spaces.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix is None or bool(prefix):
        steps.append(decoders.Strip(" ", 1, 0))  # the prefix space off again (as llama.cpp's detokenizer does)
    tok.decoder = decoders.Sequence(steps)
    return tok


def gguf_chat_template(path: str | os.PathLike[str]) -> ChatTemplate | None:
    """`tokenizer.chat_template` with the EOS token's text as its stop string; None when the file has none."""
    reader = open_reader(path)
    source = field(reader, "tokenizer.chat_template")
    if not isinstance(source, str):
        return None
    eos, tokens = field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.tokens")
    stop = [str(tokens[int(eos)])] if eos is not None and tokens else []
    return ChatTemplate(source, stop, "GGUF tokenizer.chat_template")
