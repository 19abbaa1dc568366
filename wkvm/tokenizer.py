"""Tokenizers: the protocol, HF `tokenizers` files, and the companion files that travel with a model.

A model family may give a default tokenizer for checkpoints that ship none (`ModelFamily.default_tokenizer`)."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from wkvm.atomic import atomic_path, atomic_write_bytes

if TYPE_CHECKING:
    from wkvm.chat_template import ChatTemplate


class Tokenizer(Protocol):
    # read-only: a plain attribute or a property satisfies each
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token that ends generation as EOS (`ignore_eos` ignores them all): eos_token_id and the model's other
        end tokens (HF generation_config's eos_token_id list, GGUF's end-of-turn), as transformers and vLLM stop."""
        ...

    @property
    def exact_bytes(self) -> bool:
        """token_bytes(i) is exactly token i's bytes (byte-level vocab): detokenize byte by byte."""
        ...

    @property
    def special_ids(self) -> frozenset[int]:
        """The special (control) tokens: generated text leaves them out unless a request asks for them (vLLM's
        `skip_special_tokens`, default true)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt text's tokens as the model's tokenizer starts one: BOS first where it adds one (Llama 2 and 3; as
        transformers and vLLM's completions do). A chat's rendered text is `encode`d: its template writes BOS."""
        ...

    @property
    def bos_token(self) -> str | None:
        """BOS's text (a chat template's `bos_token`), or None."""
        ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def add_bos(self) -> bool:
        """encode_prompt puts BOS first."""
        ...

    @property
    def eos_token(self) -> str | None:
        """EOS's text (a chat template's `eos_token`), or None."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


BATCH_ENCODE_CHARS = 4096  # characters: a text this long is tokenized by encode_batch, which releases the GIL


class HFTokenizer:
    """A `tokenizer.json` read by HF `tokenizers`."""

    exact_bytes = False
    more_eos: frozenset[int] = frozenset()  # the model's other end tokens (ModelSpecials.eos_ids)
    bos_token_id: int | None = None
    add_bos = False  # a prompt text starts with BOS (encode_prompt)

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None, more_eos: Iterable[int] = (),
                 bos: tuple[str | None, bool | None] = (None, None)):  # fmt: skip
        """`eos_token`: the EOS token's text (tokenizer_config.json's); without it, the first of the usual names the
        vocabulary has. `more_eos`: ids that also end generation (generation_config.json's eos_token_id). `bos`:
        tokenizer_config.json's bos_token and add_bos_token; where it says nothing, the tokenizer.json's own
        post-processor decides (Llama 3's adds `<|begin_of_text|>`)."""
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception naming no file
            raise ValueError(f"{path}: not a tokenizer.json that HF tokenizers reads ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = eos_token if eos_token is not None and self._tok.token_to_id(eos_token) is not None else None
        eos = named or next(
            (t for t in ("<|endoftext|>", "</s>", "<eos>", "<|eos|>") if self._tok.token_to_id(t) is not None),
            None,
        )
        bos_text, add_bos = bos
        plain, special = (self._tok.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        adds = special[1:] == plain and len(special) == len(plain) + 1  # the post-processor puts one token first
        bos_id = self._tok.token_to_id(bos_text) if bos_text else special[0] if adds else None
        self.set_specials(self._tok.token_to_id(eos) if eos else None, more_eos, bos_id,
                          add_bos if add_bos is not None else adds)  # fmt: skip

    def set_specials(self, eos_token_id: int | None, more_eos: Iterable[int], bos_token_id: int | None,
                     add_bos: bool) -> None:  # fmt: skip
        """EOS, the other end tokens and BOS, ids outside the vocabulary dropped (without EOS, the first other end
        token is EOS); `add_bos`: encode_prompt puts BOS first, where there is one."""
        self.more_eos = frozenset(i for i in more_eos if 0 <= i < self.vocab_size)
        self.eos_token_id = eos_token_id if eos_token_id is not None else min(self.more_eos, default=None)
        self.bos_token_id = bos_token_id if bos_token_id is not None and 0 <= bos_token_id < self.vocab_size else None
        self.add_bos = add_bos and self.bos_token_id is not None

    def encode_prompt(self, text: str) -> list[int]:
        return ([self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []) + self.encode(text)

    @property
    def bos_token(self) -> str | None:
        return self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.more_eos | ({self.eos_token_id} if self.eos_token_id is not None else set())

    def save(self, path: str | os.PathLike[str]) -> None:
        """As tokenizer.json (HF `tokenizers`' file)."""
        self._tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        # encode_batch lets other threads run meanwhile (encode holds the GIL: a 10 MB prompt stopped the server 7 s)
        if len(text) > BATCH_ENCODE_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    @functools.cached_property
    def _token_bytes(self) -> list[bytes]:
        """Every token's own bytes, as the model's vocabulary holds them: a byte-level BPE token (GPT-2, Llama 3,
        SmolLM2, Qwen) maps its characters back to bytes, so a token holding part of a character has those bytes
        rather than the U+FFFD that decoding it alone gives; a SentencePiece byte token `<0xE6>` is that byte and
        `▁` a space. Added tokens and other vocabularies: the token decoded alone. (The grammar engine and
        logprobs' `bytes` read these; before, any character split over tokens could not be produced under a
        grammar.)"""
        decoder = self._tok.decoder  # its own JSON: the whole tokenizer's (merges too) took 0.3 s for SmolLM2
        kinds = decoder_kinds(json.loads(decoder.__getstate__()) if decoder is not None else None)
        added = set(self._tok.get_added_tokens_decoder())
        pieces: list[str | None] = [None] * self.vocab_size
        for text, i in self._tok.get_vocab(with_added_tokens=True).items():  # one call, not one per id
            if 0 <= i < self.vocab_size:
                pieces[i] = text
        out = []
        for i, piece in enumerate(pieces):
            if piece is None or i in added:
                out.append(self.decode([i]).encode("utf-8"))
            elif "ByteLevel" in kinds and all(c in BYTE_DECODER for c in piece):
                out.append(bytes(BYTE_DECODER[c] for c in piece))
            elif "ByteFallback" in kinds and BYTE_PIECE.fullmatch(piece):
                out.append(bytes([int(piece[3:5], 16)]))
            elif kinds & {"Metaspace", "Replace"}:
                out.append(piece.replace("▁", " ").encode("utf-8"))
            else:
                out.append(self.decode([i]).encode("utf-8"))
        return out


BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others for
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_DECODER = gpt2_byte_decoder()


def decoder_kinds(decoder: dict[str, object] | None) -> set[str]:
    """The types in a tokenizer.json decoder (a Sequence's too)."""
    if not isinstance(decoder, dict):
        return set()
    kinds = {str(decoder.get("type"))}
    for d in decoder.get("decoders") or []:  # type: ignore[attr-defined]
        kinds |= decoder_kinds(d)
    return kinds


def load_tokenizer(
    model_path: str | os.PathLike[str], default: Callable[[], Tokenizer | None] | None = None
) -> Tokenizer:
    """`tokenizer.json` in a model directory (or `NAME.tokenizer.json` beside `NAME.pth`), else the family's
    `default` tokenizer."""
    p = Path(model_path)
    candidate = p / "tokenizer.json" if p.is_dir() else p.with_suffix(".tokenizer.json")
    if candidate.is_file():
        specials = model_specials(model_path)
        return HFTokenizer(candidate, specials.eos_token, specials.eos_ids, specials.bos)
    tokenizer = default() if default else None
    if tokenizer is None:
        raise ValueError(f"{model_path}: no {candidate.name} beside the model, and its family has no default "
                         "tokenizer: put the model's tokenizer.json there")  # fmt: skip
    return tokenizer


@dataclass(frozen=True)
class ModelSpecials:
    eos_token: str | None  # tokenizer_config.json's eos_token: the tokenizer's EOS
    eos_ids: tuple[int, ...]  # generation_config.json's (else config.json's) eos_token_id: an id or a list
    bos: tuple[str | None, bool | None] = (None, None)  # tokenizer_config.json's bos_token and add_bos_token


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken object {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def model_specials(model_path: str | os.PathLike[str]) -> ModelSpecials:
    """A model's end tokens and BOS as transformers and vLLM read them: the tokenizer's EOS and BOS from
    tokenizer_config.json, and the generation config's eos_token_id (generation stops at any of them). Instruct
    checkpoints need both: Qwen3.5's EOS is `<|im_end|>` there while its tokenizer.json's usual name is
    `<|endoftext|>`, so chats ran on past the turn's end."""
    p = Path(model_path)
    tok_cfg = read_json(companion_path(p, "tokenizer_config.json"))
    add_bos = tok_cfg.get("add_bos_token")
    bos = (token_text(tok_cfg.get("bos_token")), add_bos if isinstance(add_bos, bool) else None)
    ids: list[int] = []
    if p.is_dir():
        for name in ("generation_config.json", "config.json"):
            cfg = read_json(p / name)
            text = cfg.get("text_config")  # an object, if any (a string there had been an AttributeError traceback)
            value = cfg.get("eos_token_id", text.get("eos_token_id") if isinstance(text, dict) else None)
            found = [value] if isinstance(value, int) else value if isinstance(value, list) else []
            ids = [i for i in found if isinstance(i, int) and not isinstance(i, bool)]
            if ids:
                break  # the generation config's list is the one generate() uses
    return ModelSpecials(token_text(tok_cfg.get("eos_token")), tuple(ids), bos)


def read_json(path: Path) -> dict[str, Any]:
    """A companion JSON file's object ({} when there is none); ValueError naming the file when it is not JSON."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return data if isinstance(data, dict) else {}


DIRECTORY_ONLY = ("tokenizer_config.json", "generation_config.json")  # companions a .pth has no place for
TOOL_USE_TEMPLATE = "additional_chat_templates/tool_use.jinja"  # transformers' named template for requests with tools
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "chat_template.json", TOOL_USE_TEMPLATE)  # fmt: skip


def companion_path(model_path: str | os.PathLike[str], name: str) -> Path:
    """Where a model keeps its companion file `name`: inside a directory (HF, pack), or `NAME.<name>` beside a
    `.pth` (only the tokenizer and chat template files have that form)."""
    p = Path(model_path)
    return p / name if p.is_dir() or not p.suffix else p.parent / f"{p.stem}.{name}"  # with_name refuses a '/'


def copy_companions(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer and chat template files that go with model `src` to converted model `dst`, so the
    converted model encodes text and formats chats the same way. Returns the names copied."""
    copied = []
    for name in COMPANIONS:
        source, target = companion_path(src, name), companion_path(dst, name)
        if Path(dst).suffix == ".pth" and name in (*DIRECTORY_ONLY, TOOL_USE_TEMPLATE):
            continue  # a .pth has no place for them (its chat template would need NAME.chat_template.jinja)
        if source.is_file():  # (atomic_path makes additional_chat_templates/)
            atomic_write_bytes(target, source.read_bytes())
            copied.append(name)
    return copied


def save_text_tools(tokenizer: HFTokenizer | None, template: ChatTemplate | None, out: Path) -> list[str]:
    """A tokenizer and chat template built in memory (from a GGUF file's metadata) as an HF directory's files:
    tokenizer.json, tokenizer_config.json (the EOS, as transformers reads it), generation_config.json (every end
    token), chat_template.jinja and .json (its stop strings). A converted directory or a weight pack then tokenizes,
    stops and formats chats as its source did (a pack made from a GGUF had none of them: no tokenizer at all).
    Returns the names written."""
    written = []
    if tokenizer is not None:
        with atomic_path(out / "tokenizer.json") as tmp:
            tokenizer.save(tmp)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token,
                  "bos_token": tokenizer.bos_token, "add_bos_token": tokenizer.add_bos}
        files = {"tokenizer_config.json": config,
                 "generation_config.json": {"eos_token_id": sorted(tokenizer.eos_token_ids)}}  # fmt: skip
        for name, content in files.items():
            atomic_write_bytes(out / name, json.dumps(content, indent=2).encode())
        written += ["tokenizer.json", *files]
    if template is not None and template.source is not None:
        atomic_write_bytes(out / "chat_template.jinja", template.source.encode())
        atomic_write_bytes(out / "chat_template.json", json.dumps({"stop": template.stop,
                                                                   "name": "chat_template.jinja"}).encode())
        written += ["chat_template.jinja", "chat_template.json"]
        if template.tool_source is not None:
            atomic_write_bytes(out / TOOL_USE_TEMPLATE, template.tool_source.encode())
            written.append(TOOL_USE_TEMPLATE)
    return written
