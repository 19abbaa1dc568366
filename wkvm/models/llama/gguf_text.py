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

import functools
import logging
import os
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizers

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import CheckpointError, first_line
from wkvm.models.llama.gguf_file import field, metadata_number, native_dtype, of_architecture, open_reader
from wkvm.tokenizer import HFTokenizer, Tokenizer

log = logging.getLogger("wkvm.gguf")

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokens llama.cpp ends generation at whatever the file names as EOS, and treats as control tokens (llama-vocab.cpp's
# end-of-generation texts): a Llama 3 base model's file names <|end_of_text|> only, but its chats end with <|eot_id|>;
# a ChatML fine-tune of Llama 2 names <|im_end|>, and </s> still ends it
END_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<|end_of_text|>", "</s>", "<eos>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<end_of_utterance>",
                       "<｜end▁of▁sentence｜>"})  # fmt: skip
DIGITS_FIRST = ("smollm", "starcoder", "refact")  # llama.cpp: "\p{N}" then the GPT-2 split
GPT2 = ("default", "gpt-2", "gpt2")
LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "falcon3", "lfm2")  # llama.cpp's names for Llama 3's split
# DeepSeek LLM / Coder (llama architecture): splits one after another, each cutting the last one's pieces, as their
# tokenizer.json and llama.cpp's llama-vocab.cpp give them: line breaks, letters (the LLM's as a list of ranges), then
# punctuation, trailing spaces, CJK runs, digits
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_SPLITS = {
    "deepseek-llm": [
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
        "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
        "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
        "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
        "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
        "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
        "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        CJK,
        "\\p{N}+",
    ],
    "deepseek-coder": ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", CJK, "\\p{N}"],
}


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
    if pre in DEEPSEEK_SPLITS:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEEPSEEK_SPLITS[pre]]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = ", ".join(DIGITS_FIRST + GPT2 + LLAMA3 + tuple(DEEPSEEK_SPLITS))
    raise CheckpointError(f"GGUF tokenizer.ggml.pre {pre!r} is not one wkvm rebuilds (known: {known}); the model's "
                          "own tokenizer.json beside the file as <file name>.tokenizer.json is used instead")


class GGUFTokenizer(HFTokenizer):
    """An HFTokenizer over a `tokenizers` object built in memory rather than read from tokenizer.json."""

    def __init__(self, tok: HFTokenizers, tokens: list[str], eos_token_id: int | None,
                 more_eos: frozenset[int] = frozenset(), bos_token_id: int | None = None, add_bos: bool = False,
                 user_defined: dict[int, str] | None = None):  # fmt: skip
        """`tokens`: the file's vocabulary, each id's text (a text held by several ids is one entry of `tok`'s
        vocabulary); `user_defined`: the vocabulary's user-defined tokens (id -> text), whose text decodes as it is."""
        self._tok = tok  # no file to read: super's __init__ is not run
        self.vocab_size = len(tokens)
        self._same_text = shadowed_ids(tok, tokens)
        self.set_specials(eos_token_id, more_eos, bos_token_id, add_bos)
        self._user_defined = user_defined or {}

    def decode(self, ids: list[int]) -> str:
        """As llama.cpp's `token_to_piece`, a user-defined token is its own text: `tokenizers` runs added tokens
        through the vocabulary's decoder, and a byte-level one maps letters of GPT-2's byte alphabet to single
        bytes: DeepSeek LLM / Coder mark ü ö ø ú ... as user-defined, and every one came out as U+FFFD ("M�ller";
        hunt, session 48; huggingface/tokenizers#1424). An id whose text a later id of the file also holds decodes
        as that one (the same text)."""
        if self._same_text:
            ids = [self._same_text.get(i, i) for i in ids]
        if not self._user_defined or self._user_defined.keys().isdisjoint(ids):  # (most vocabularies have none)
            return super().decode(ids)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            text = self._user_defined.get(i)
            if text is None:
                run.append(i)
                continue
            if run:
                out.append(super().decode(run))
                run = []
            out.append(text)
        if run:
            out.append(super().decode(run))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        return super().token_bytes(self._same_text.get(token_id, token_id))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        kept = super().special_ids
        return kept | {i for i, j in self._same_text.items() if j in kept}


def shadowed_ids(tok: HFTokenizers, tokens: list[str]) -> dict[int, int]:
    """id -> the id `tok` keeps for its text, for every id of `tokens` whose text a later id holds too: a `tokenizers`
    vocabulary holds a text once, so it encodes as the last id, as llama.cpp's (`token_to_id` keeps the last one),
    and had decoded the earlier ids as nothing (and counted them out of the vocabulary's size). llama.cpp's
    `token_to_piece` gives both ids the text."""
    if len(set(tokens)) == len(tokens):  # (most vocabularies)
        return {}
    kept = ((i, tok.token_to_id(t)) for i, t in enumerate(tokens))
    return {i: j for i, j in kept if j is not None and j != i}


def gguf_tokenizer(path: str | os.PathLike[str]) -> GGUFTokenizer:
    reader = open_reader(path)
    model = field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', and "
                              "SentencePiece, 'llama', are)")  # fmt: skip
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens is not a list of strings")
    if not tokens:
        raise CheckpointError(f"{path}: the file carries no vocabulary (tokenizer.ggml.tokens): put the model's "
                              f"tokenizer.json beside it as {Path(path).stem}.tokenizer.json")  # fmt: skip
    # an empty token is "[EMPTY_<id>]" to llama.cpp (llama-vocab.cpp): its text when generated, each its own
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    if not isinstance(types, list) or not all(isinstance(k, int) for k in types):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type is not a list of integers")
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    pre = field(reader, "tokenizer.ggml.pre") or "default"
    longer = any(len(t) > 1 and k == TokenType.NORMAL for t, k in zip(tokens, types, strict=True))
    if model == "gpt2" and longer and not field(reader, "tokenizer.ggml.merges"):
        # tokens of several characters that no merge can make: every text had been tokenized byte by byte
        raise CheckpointError(f"{path}: a byte-level BPE vocabulary ('gpt2') with tokens of several characters but "
                              "no tokenizer.ggml.merges")  # fmt: skip
    try:
        tok = sentencepiece(reader, tokens, types) if model == "llama" else byte_level_bpe(reader, tokens, pre)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # tokenizers' own (a merge naming a token the vocabulary lacks): one line, not a traceback
        raise CheckpointError(f"{path}: the tokenizer metadata does not build ({first_line(str(e), 200)})") from None
    special = (TokenType.CONTROL, TokenType.UNKNOWN) if model == "llama" else (TokenType.CONTROL,)
    marked = [(t, k, k in special or t in END_TEXTS) for t, k in zip(tokens, types, strict=True)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _, s in marked if s])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k, s in marked if k == TokenType.USER_DEFINED and not s])
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    for kind in ("eos", "bos", "eot", "eom"):
        key = f"tokenizer.ggml.{kind}_token_id"
        if (i := field(reader, key)) is None:
            continue
        try:
            i = metadata_number(key, i, accept=(int,), what="a token id")
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if not 0 <= i < len(tokens):
            raise CheckpointError(f"{path}: {key} {i} is outside the vocabulary of {len(tokens)} tokens")
    # llama.cpp also ends generation at the end-of-turn and end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>),
    # named in the file or found by their text
    named = (field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom"))
    ends = [*named, *(i for i, t in enumerate(tokens) if t in END_TEXTS)]
    # BOS first in a prompt: as the file says, else llama.cpp's default for the vocabulary (SentencePiece's and Llama
    # 3's add it)
    bos, add_bos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.add_bos_token")
    default_bos = model == "llama" or pre in LLAMA3
    # byte-level vocabularies only: there the decoder maps a user-defined token's letters to bytes; a SentencePiece
    # one's decodes it right, and decoding around it apart would drop the space of a ▁word after it (review, 48)
    user_defined = {i: t for i, (t, k, s) in enumerate(marked) if k == TokenType.USER_DEFINED and not s}
    user_defined = user_defined if model == "gpt2" else {}
    return GGUFTokenizer(tok, tokens, None if eos is None else int(eos),
                         frozenset(int(i) for i in ends if i is not None), None if bos is None else int(bos),
                         bool(add_bos) if add_bos is not None else default_bos, user_defined)  # fmt: skip


def byte_level_bpe(reader: Any, tokens: list[str], pre: str) -> HFTokenizers:
    merges: list[str] = field(reader, "tokenizer.ggml.merges") or []
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise CheckpointError("tokenizer.ggml.merges is not a list of 'left right' strings")
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
    ranked = []  # (-score, id, split): the best-scoring token first; equal scores by token id (below)
    for i, (t, score) in enumerate(zip(tokens, scores, strict=True)):
        if types[i] == TokenType.BYTE:
            continue
        ranked += [(-score, i, j) for j in range(1, len(t)) if t[:j] in ids and t[j:] in ids]
    ranked.sort()
    merges = [(tokens[i][:j], tokens[i][j:]) for _, i, j in ranked]
    if len({-r[0] for r in ranked}) < len({r[1] for r in ranked}) / 2:
        # llama.cpp's converter writes -1000 for every token of a SentencePiece model that ships only tokenizer.json
        # (gguf.LlamaHfVocab): llama.cpp then joins the leftmost pair first, which a BPE cannot; ties go by token id,
        # which is the merge order of a BPE-trained vocabulary
        log.warning("this GGUF's SentencePiece scores are mostly equal (written without scores): ties between "
                    "merges go by token id, the vocabulary's order; llama.cpp takes the leftmost pair there, so some "
                    "texts encode otherwise than llama.cpp encodes them")  # fmt: skip
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    tok = HFTokenizers(models.BPE(vocab=ids, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = field(reader, "tokenizer.ggml.add_space_prefix")
    prefix = prefix is None or bool(prefix)  # llama.cpp's default for SentencePiece: a space first
    # HF runs the normalizer on each stretch of text between added tokens: Prepend then puts a ▁ at the start and after
    # every special token, where llama.cpp puts its prefix space; the decoder's Strip takes it off again (as llama.cpp's
    # detokenizer does)
    first = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*first, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))  # fmt: skip
    return tok


def gguf_chat_template(path: str | os.PathLike[str]) -> ChatTemplate | None:
    """`tokenizer.chat_template` with the EOS token's text as its stop string (and llama.cpp's named
    `tokenizer.chat_template.tool_use` for requests with tools); None when the file has none."""
    reader = open_reader(path)
    source = field(reader, "tokenizer.chat_template")
    if not isinstance(source, str):
        return None
    eos, tokens = field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.tokens")
    stop = [str(tokens[int(eos)])] if eos is not None and tokens else []
    tool_use = field(reader, "tokenizer.chat_template.tool_use")
    return ChatTemplate(source, stop, "GGUF tokenizer.chat_template",
                        tool_source=tool_use if isinstance(tool_use, str) else None)


class GGUFFamilyParts:
    """What a family that also reads llama.cpp GGUF files of its architecture gives the loader for such a file (LFM2,
    Granite 4.0 H, Nemotron-H): which files are its (`detect`), their own tokenizer and chat template, and their
    precision for `--dtype auto` (`gguf_file.native_dtype` over the architecture's layer matrices); for HF
    directories none and float32. A family sets `gguf_architecture` and `gguf_matrices`."""

    gguf_architecture: str
    gguf_matrices: tuple[str, ...]

    def detect(self, path: Path) -> str | None:
        """"gguf" for a file of the family's architecture; HF directories the registry matches by model_type."""
        return of_architecture(path, self.gguf_architecture)

    def default_tokenizer(self, path: Path) -> Tokenizer | None:
        return gguf_tokenizer(path) if self.detect(path) else None

    def default_chat_template(self, path: Path) -> ChatTemplate | None:
        return gguf_chat_template(path) if self.detect(path) else None

    def native_dtype(self, path: Path, fmt: str) -> str:
        return native_dtype(path, self.gguf_matrices) if fmt == "gguf" else "float32"
