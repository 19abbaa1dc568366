"""World tokenizer: ids identical to BlinkDL's TRIE_TOKENIZER; lossless round trip; HF tokenizer.json."""

import json
import os
from pathlib import Path

import pytest

from wkvm.engine.detokenizer import Detokenizer
from wkvm.models.rwkv7.tokenizer import WorldTokenizer, literal_bytes
from wkvm.tokenizer import HFTokenizer, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "中文测试：我爱北京天安门。混合 English 和中文 text.",
    "Emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇯🇵 mixed with ünïcödé and ℕ ⊆ ℤ.",
    "def f(x):\n\treturn {'a': [x ** 2 for x in range(10)]}  # code\n\n\n",
    "User: hi\n\nAssistant: Hello!\n\n" * 3,
    "\x00\x01 control \r\n and   spaces    ",
    "日本語のテキストと한국어 텍스트, Русский текст, العربية",
]


@pytest.fixture(scope="module")
def world():
    return WorldTokenizer()


@pytest.fixture(scope="module")
def trie():
    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    return TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__), "rwkv_vocab_v20230424.txt"))


@pytest.mark.parametrize("text", TEXTS)
def test_world_ids_match_blinkdl_trie(world, trie, text):
    ids = world.encode(text)
    assert ids == trie.encode(text)
    assert world.decode(ids) == text


def test_world_vocab(world):
    assert world.vocab_size == 65530
    assert world.token_bytes(0) == b"" and world.eos_token_id == 0


def test_world_byte_table_equals_blinkdls(world, trie):
    """The byte table reads most lines without `ast.literal_eval` (plain quoted strings): every token's bytes are
    BlinkDL's (its tokenizer evaluates every line)."""
    assert world._bytes == trie.idx2token


def test_partial_utf8_is_held_until_complete(world):
    ids = world.encode("🎉")
    assert len(ids) > 1, "emoji should span several byte tokens"
    d = Detokenizer(world)
    for t in ids[:-1]:
        d.add(t)
        assert "\ufffd" not in d.text
    d.add(ids[-1])
    assert d.text == "🎉"


def test_stop_string_spanning_tokens(world):
    text = "alpha beta gamma delta"
    d = Detokenizer(world, stop=["a gam"])
    released = ""
    for t in world.encode(text):
        if d.add(t):
            break
        released += d.delta()
    released += d.delta(final=True)
    assert d.stopped and d.text == "alpha bet" and released == "alpha bet"


def test_only_a_possible_stop_string_start_is_held_back(world):
    """Text streams as it comes; only an end that could begin a stop string waits for the next tokens."""
    d = Detokenizer(world, stop=["<|im_end|>", "\n\nUser:"])
    out = []
    for piece in ["The capital", " is Paris", ".<|im", "_", "x", "\n", "\nUs", "ed"]:
        for t in world.encode(piece):
            d.add(t)
        out.append(d.delta())
    assert out == ["The capital", " is Paris", ".", "", "<|im_x", "", "", "\n\nUsed"]
    assert d.delta(final=True) == ""


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["to be or not to be, that is the question"] * 20, trainer)
    (tmp_path / "m").mkdir()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "m")
    assert isinstance(loaded, HFTokenizer) and loaded.eos_token_id == 0
    ids = loaded.encode("to be or not")
    assert loaded.decode(ids) == "to be or not"
    d = Detokenizer(loaded, stop=["not"])
    for t in loaded.encode("to be or not to be"):
        if d.add(t):
            break
    assert d.text == "to be or "


def test_a_long_text_is_tokenized_by_encode_batch_to_the_same_ids():
    """Over BATCH_ENCODE_CHARS characters HF tokenizers' encode_batch encodes (it lets other threads run meanwhile;
    encode held the GIL: a 10 MB prompt stopped every other request for 7 s, hunt 15). This checks only that the ids
    are encode's; the GIL's release is measured, not tested (a 3.3 MB text: the longest pause of another thread
    0.10 s against 1.99 s with encode, session 28's note)."""
    from wkvm.tokenizer import BATCH_ENCODE_CHARS as LONG_TEXT

    for kind in ("bytelevel", "metaspace"):
        hf, tok = _trained(kind)
        hf._tok, hf.vocab_size, hf.eos_token_id = tok, tok.get_vocab_size(), 0
        text = "\n".join(TEXTS) * (4 * LONG_TEXT // len("\n".join(TEXTS)))
        assert len(text) > LONG_TEXT and hf.encode(text) == tok.encode(text, add_special_tokens=False).ids


def test_a_models_own_end_tokens_end_generation(tmp_path, tiny_pth):
    """tokenizer_config.json's eos_token is the EOS and generation_config.json's eos_token_id list ends generation too,
    as transformers and vLLM stop (hunt 14: a Qwen3.5-style instruct checkpoint, EOS `<|im_end|>` there but only
    `<|endoftext|>` found by name in tokenizer.json, ran every chat answer on to max_tokens); ignore_eos ignores them
    all; a file that is not JSON, or a tokenizer.json that does not read, is one error naming the file."""
    import shutil

    from tokenizers import AddedToken, Tokenizer, models

    from wkvm.config import EngineConfig
    from wkvm.engine.engine import Engine
    from wkvm.sampling_params import SamplingParams
    from wkvm.weights.loader import load_model

    vocab = {chr(97 + i): i for i in range(26)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    end, start, turn = (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    m = tmp_path / "m"
    m.mkdir()
    tok.save(str(m / "tokenizer.json"))
    assert load_tokenizer(m).eos_token_ids == {end}  # by name, as before: no config says otherwise
    (m / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>", "special": True}}))
    (m / "generation_config.json").write_text(json.dumps({"eos_token_id": [turn, end, 10_000]}))
    (m / "config.json").write_text(json.dumps({"eos_token_id": start}))  # the generation config's list comes first
    loaded = load_tokenizer(m)
    assert loaded.eos_token_id == turn and loaded.eos_token_ids == {turn, end}  # an id beyond the vocabulary: dropped
    (m / "generation_config.json").unlink()
    assert load_tokenizer(m).eos_token_ids == {turn, start}
    # a text_config that is no object is left alone (an AttributeError traceback that stopped `wkvm serve`; loading
    # hunt, session 49)
    (m / "generation_config.json").write_text(json.dumps({"text_config": "x"}))
    assert load_tokenizer(m).eos_token_ids == {turn, start}
    (m / "generation_config.json").unlink()

    # the engine stops at any of them, and ignore_eos ignores them all (the RWKV test model reads any token id)
    pth = tmp_path / "w.pth"
    shutil.copy(tiny_pth, pth)
    engine = Engine(load_model(pth), loaded, EngineConfig(n_slots=2))
    for forced in (turn, end):
        bias = {forced: 100.0}
        stops = engine.submit([1, 2], SamplingParams(max_tokens=5, temperature=0, logit_bias=bias))
        goes_on = engine.submit([1, 2], SamplingParams(max_tokens=3, temperature=0, logit_bias=bias, ignore_eos=True))
        engine.run_until_done()
        assert stops.output.token_ids == [forced] and stops.output.finish_reason == "stop"
        assert goes_on.output.token_ids == [forced] * 3 and goes_on.output.finish_reason == "length"
    (m / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not JSON"):
        load_tokenizer(m)
    (m / "tokenizer_config.json").unlink()
    (m / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer.json"):
        load_tokenizer(m)


def _trained(kind: str):
    """A small HF tokenizer trained in the test: byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen) or Metaspace BPE (the
    SentencePiece way: a space marker, a prefix space stripped at the start of the decoded text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "bytelevel":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<unk>"], initial_alphabet=alphabet)
    tok.train_from_iterator(TEXTS * 10, trainer)
    return HFTokenizer.__new__(HFTokenizer), tok


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_windowed_detokenizer_gives_the_whole_decode(kind):
    """A tokenizer without exact token bytes is detokenized over a short window of tokens (not the whole output each
    token): the text it releases, token by token and then at the end, is the whole output's decode, for real text
    and for random token ids (partial UTF-8 in the middle and at the end included)."""
    import random

    hf, tok = _trained(kind)
    hf._tok, hf.vocab_size, hf.eos_token_id = tok, tok.get_vocab_size(), 0
    rng = random.Random(0)
    cases = [hf.encode(t) for t in TEXTS] + [[rng.randrange(hf.vocab_size) for _ in range(rng.randrange(1, 60))]
                                             for _ in range(300)]  # fmt: skip
    for ids in cases:
        d, released = Detokenizer(hf), ""
        for t in ids:
            d.add(t)
            released += d.delta()
        d.flush()
        released += d.delta(final=True)
        assert released == d.text == hf.decode(ids), ids


def test_offsets_of_tokens_holding_part_of_a_character():
    """Legacy completion logprobs: each token's text_offset is where its text starts in the output; a token holding
    part of a character (byte-level BPE splits 日 and 本 over two tokens each) points where that character starts
    (before, each such token counted as one character, U+FFFD, and the offsets after it ran ahead)."""
    from types import SimpleNamespace

    import wkvm
    from wkvm.server.generation import completion_logprobs

    tok = HFTokenizer(Path(wkvm.__file__).parent / "assets" / "wkvm-tiny-shakespeare" / "tokenizer.json")
    text = "a日本b c"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # some characters take several tokens
    lps = completion_logprobs(SimpleNamespace(tokenizer=tok), ids, [{t: 0.0} for t in ids], 0, offset=5)
    expected, at = [], 0
    for t in ids:  # the character holding the token's first byte
        expected.append(5 + len(text.encode()[:at].decode("utf-8", errors="ignore")))
        at += len(tok.token_bytes(t))
    assert lps["text_offset"] == expected and at == len(text.encode())


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_special_tokens_are_left_out_of_the_text_unless_asked_for(kind):
    """vLLM's skip_special_tokens: a special token the model emits adds no text (the default), or its own text
    (false); stop strings then see the text without it; the legacy logprobs' text_offset skips it too."""
    from types import SimpleNamespace

    from wkvm.server.generation import completion_logprobs

    hf, tok = _trained(kind)
    hf._tok, hf.vocab_size, hf.eos_token_id = tok, tok.get_vocab_size(), None
    special = tok.token_to_id("<|endoftext|>")
    assert hf.special_ids == frozenset({special, tok.token_to_id("<unk>")})
    ids = [*hf.encode("to be or"), special, *hf.encode(" not to be")]
    kept, skipped = Detokenizer(hf), Detokenizer(hf, skip=hf.special_ids)
    for t in ids:
        kept.add(t)
        skipped.add(t)
    kept.flush()
    skipped.flush()
    assert "<|endoftext|>" in kept.text and skipped.text == kept.text.replace("<|endoftext|>", "")
    stop = Detokenizer(hf, stop=["or not"], skip=hf.special_ids)  # spans the special token, as text without it
    assert any(stop.add(t) for t in ids) and stop.text == "to be "
    ctx = SimpleNamespace(tokenizer=hf)
    offsets = completion_logprobs(ctx, ids, [{t: 0.0} for t in ids], 0, skip=hf.special_ids)["text_offset"]
    at = ids.index(special)
    assert offsets[at - 1] < offsets[at] == offsets[at + 1]  # it takes no room in the text


def test_a_stop_string_in_text_held_back_at_the_end_is_found():
    """A windowed tokenizer's token holding a space and a cut character's first bytes holds the space back; when the
    generation ends there (max_tokens), the flushed text was appended without looking for stop strings: the stop
    string stayed in the text and the reason was "length"."""
    from types import SimpleNamespace

    pieces = [b"Answer:", b" \xf0\x9f", b"x"]
    tok = SimpleNamespace(exact_bytes=False,
                          decode=lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"))
    for stop, include, want in ((": ", False, "Answer"), (": ", True, "Answer: "), ("zz", False, "Answer: \ufffd")):
        d = Detokenizer(tok, stop=[stop], include_stop=include)
        assert not d.add(0) and not d.add(1) and d.text == "Answer:"
        d.flush()
        assert d.stopped == (stop != "zz") and d.text == want, (stop, d.text)
    d = Detokenizer(tok, stop=[": "], min_tokens=2)  # stop strings count only after min_tokens
    d.add(0), d.add(1), d.flush()
    assert not d.stopped and d.text == "Answer: \ufffd"


def test_every_vocab_literal_reads_as_python_reads_it():
    """The World vocab's literals are read without the ast module (not thread-safe in CPython 3.11): every one of its
    65,529 lines, str or bytes, escaped or not, gives the bytes `ast.literal_eval` gives."""
    import ast

    tok = WorldTokenizer()
    lines = tok.vocab_file.read_text(encoding="utf-8").splitlines()
    escaped = 0
    for line in lines:
        literal = line.split(" ", 1)[1].rsplit(" ", 1)[0]
        value = ast.literal_eval(literal)
        assert literal_bytes(literal) == (value.encode("utf-8") if isinstance(value, str) else value), line
        escaped += "\\" in literal
    assert len(lines) == 65529 and escaped == 840  # the escaped ones take the slow path
    assert tok.token_bytes(10) == literal_bytes(lines[9].split(" ", 1)[1].rsplit(" ", 1)[0])


def test_legacy_top_logprobs_name_part_of_a_character_by_its_bytes():
    """Completions' top_logprobs is keyed by token text: tokens holding part of a character had all been U+FFFD, one
    key, so fewer entries came back than asked, holding the least likely one's value, and the chosen token's entry
    disagreed with its token_logprobs (hunt, session 49). They are `bytes:\\xNN...` as OpenAI names them."""
    from types import SimpleNamespace

    import wkvm
    from wkvm.server.generation import completion_logprobs

    tok = HFTokenizer(Path(wkvm.__file__).parent / "assets" / "wkvm-tiny-shakespeare" / "tokenizer.json")
    partial = [t for t in range(tok.vocab_size) if not _utf8(tok.token_bytes(t))][:6]
    assert len(partial) == 6  # a byte-level vocabulary: its single bytes 0x80-0xff
    lp = {t: -float(i + 1) for i, t in enumerate(partial)}
    out = completion_logprobs(SimpleNamespace(tokenizer=tok), [partial[2]], [lp], 5)
    assert out is not None
    (top,) = out["top_logprobs"]
    assert len(top) == 5 and list(top.values()) == [-1.0, -2.0, -3.0, -4.0, -5.0]
    chosen = out["tokens"][0]
    assert chosen == "bytes:" + "".join(f"\\x{b:02x}" for b in tok.token_bytes(partial[2]))
    assert top[chosen] == out["token_logprobs"][0] == -3.0


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
