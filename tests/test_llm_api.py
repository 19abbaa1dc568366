"""The offline Python API: LLM.generate with strings or token ids, greedy, logprobs, finish reasons."""

import pytest
import torch
from conftest import greedy_reference

from wkvm import LLM, SamplingParams
from wkvm.engine.runner import bad_word_ids
from wkvm.sampling_params import InvalidParam


@pytest.fixture(scope="module")
def llm(tiny_pth):
    return LLM(model=tiny_pth)


def test_greedy_token_ids_match_model_loop(llm):
    prompts = [[1, 2, 3], [50, 60, 70, 80, 90], [7]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == greedy_reference(llm.model, p, 12)
        assert o.finish_reason == "length" and o.prompt_token_ids == p


def test_batch_equals_alone(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    together = llm.generate(prompts, params)
    for p, o in zip(prompts, together, strict=True):
        assert llm.generate([p], params)[0].token_ids == o.token_ids


def test_logprobs_topk_and_chosen(llm):
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
    logits, _ = llm.model.prefill([4, 5, 6])
    expected = torch.log_softmax(logits, -1)
    assert abs(out.logprobs[0][out.token_ids[0]] - expected[out.token_ids[0]].item()) < 1e-5


def test_string_prompt_and_text(world_pth):
    llm = LLM(model=world_pth)
    out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Hi")
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_stop_token_ids_and_eos(llm):
    first = llm.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first[2]]))[0]
    assert out.token_ids == first[:3] and out.finish_reason == "stop"
    # the stop token's text is left out, as vLLM's detokenizer does, and kept with include_stop_str_in_output (hunt 13:
    # it always stayed, and the flag did nothing)
    assert out.text == llm.tokenizer.decode(first[:2])
    kept = llm.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first[2]],
                                                 include_stop_str_in_output=True))[0]  # fmt: skip
    assert kept.token_ids == first[:3] and kept.text == llm.tokenizer.decode(first[:3]) != out.text


def test_logit_bias_bans_and_forces_tokens_and_leaves_logprobs_raw(llm):
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    first = llm.generate([[1, 2]], plain)[0]
    banned = first.token_ids[0]
    out = llm.generate([[1, 2]], SamplingParams(**{**plain.__dict__, "logit_bias": {banned: -100.0}}))[0]
    assert banned not in out.token_ids  # banned at every position, not only the first
    assert first.logprobs is not None and out.logprobs is not None
    runner_up = next(t for t in sorted(first.logprobs[0], key=first.logprobs[0].get, reverse=True) if t != banned)
    assert out.token_ids[0] == runner_up  # the greedy choice among the rest
    # logprobs are the model's own, before the bias: the first position's equal the unbiased run's
    assert out.logprobs[0][runner_up] == pytest.approx(first.logprobs[0][runner_up], abs=1e-6)
    assert out.logprobs[0][banned] == pytest.approx(first.logprobs[0][banned], abs=1e-6)
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias={7: 100.0})
    assert llm.generate([[1, 2]], forced)[0].token_ids == [7] * 6  # sampled: all the mass on token 7


def test_allowed_token_ids_and_bad_words(llm):
    """vLLM's allowed_token_ids (only those are sampled) and bad_words (a word's tokens never come out in a row, in
    either of its forms: after a space or not)."""
    allowed = [5, 9, 11, 40]
    for seed in range(3):
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, allowed_token_ids=allowed)
        assert set(llm.generate([[1, 2]], p)[0].token_ids) <= set(allowed)
    first = llm.generate([[1, 2]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    # a word the greedy output has (a random model: any of its tokens whose text is a word in either form)
    words = [llm.tokenizer.decode([t]).strip() for t in first.token_ids]
    word = next(w for w in words if w and any(contains(first.token_ids, f) for f in bad_word_ids(llm.tokenizer, [w])))
    forms = bad_word_ids(llm.tokenizer, [word])
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word]))[0]
    assert not any(contains(out.token_ids, f) for f in forms), (word, out.text)
    with pytest.raises(InvalidParam):
        SamplingParams(bad_words=["  "])


def contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_min_tokens_holds_back_stop_tokens_and_strings(llm):
    """vLLM's min_tokens: until that many tokens are out, stop_token_ids (and EOS) cannot be sampled and stop strings
    do not stop; after that they do."""
    first = llm.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_id = first.token_ids[1]
    short = llm.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id]))[0]
    assert short.token_ids == first.token_ids[:2] and short.finish_reason == "stop"
    held = llm.generate([[1, 2]], SamplingParams(max_tokens=8, min_tokens=5, temperature=0,
                                                 stop_token_ids=[stop_id]))[0]  # fmt: skip
    assert held.token_ids[0] == first.token_ids[0] and stop_id not in held.token_ids[:5]
    assert len(held.token_ids) == 8 if stop_id not in held.token_ids else held.token_ids[-1] == stop_id
    stop = first.text[:1]
    assert stop, "the model's first 8 greedy tokens give no text"
    cut = llm.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == "" and len(cut.token_ids) < 8
    m = len(cut.token_ids) + 1  # the stop string came out before this many tokens: it no longer stops
    kept = llm.generate([[1, 2]], SamplingParams(max_tokens=8, min_tokens=m, temperature=0, ignore_eos=True,
                                                 stop=[stop]))[0]  # fmt: skip
    assert kept.token_ids[:m] == first.token_ids[:m] and kept.text.startswith(stop)
    with pytest.raises(InvalidParam, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    full = llm.generate([[1, 2]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    assert len(full) >= 3, full
    stop = full[1:3]
    at = full.find(stop)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop, "\x00never"])
    assert llm.generate([[1, 2]], p)[0].text == full[:at]
    p.include_stop_str_in_output = True
    kept = llm.generate([[1, 2]], p)[0]
    assert kept.text == full[: at + 2] and kept.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = llm.generate([[1, 2, 3]], p)[0].token_ids
    b = llm.generate([[1, 2, 3]], p)[0].token_ids
    assert a == b


def test_bad_input_is_refused(llm):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.generate([[1, 99999]])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(InvalidParam, match="temperature"):
        SamplingParams(temperature=-1)


def test_wrong_types_are_refused_by_name(llm, tiny_pth):
    """Python API hunt (session 47): these had failed deep inside (AttributeError on .lower(), TypeError from len()
    or list()) or been taken ("no" as true, "x" as one priority per character)."""
    for name, value in [("stop", [1]), ("stop_token_ids", 5), ("ignore_eos", "no"),
                        ("include_stop_str_in_output", 1), ("skip_special_tokens", None)]:  # fmt: skip
        with pytest.raises(InvalidParam, match=name) as e:
            SamplingParams(**{name: value})
        assert e.value.param == name
    assert SamplingParams(stop=("a", "b"), stop_token_ids=None).stop == ["a", "b"]
    with pytest.raises(TypeError, match="priority is an int"):
        llm.generate([[1, 2]], priority="x")
    with pytest.raises(TypeError, match="messages is a list"):
        llm.chat("hello")
    for bad in (1.5, "2", True):
        with pytest.raises(ValueError, match="weight_cache_layers must be an integer"):
            LLM(model=tiny_pth, weight_cache_layers=bad)
    for bad in (None, torch.float16, "fp64"):
        with pytest.raises(ValueError, match="use float32, bfloat16, int8, int4 or auto"):
            LLM(model=tiny_pth, dtype=bad)
    # offline API hunt (session 49): one bad word had been its letters, each banned; a text as prompt_token_ids run
    # as the text; a prompt of no kind a list() error; a field set after the params were made failed deep in the
    # engine (the batch with it); chat_template_kwargs of another type blamed on the messages; a set of allowed ids
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
    assert SamplingParams(allowed_token_ids={3, 4}).allowed_token_ids == [3, 4]
    assert SamplingParams(allowed_token_ids=range(3, 5)).allowed_token_ids == [3, 4]
    with pytest.raises(TypeError, match="'prompt_token_ids' is a list of ints, not str"):
        llm.generate({"prompt_token_ids": "ROMEO"})
    for bad in (5, None):
        with pytest.raises(TypeError, match="prompts are a str"):
            llm.generate(bad)
    sp = SamplingParams(max_tokens=4)
    sp.max_tokens = None
    with pytest.raises(InvalidParam, match="max_tokens"):
        llm.generate([[1, 2], [3, 4]], sp)
    sp.max_tokens, sp.temperature = 4, -1.0
    with pytest.raises(InvalidParam, match="temperature"):
        llm.generate([[1, 2]], sp)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids  # usable after


def test_a_torch_dtype_or_any_case_names_the_dtype(tiny_pth):
    """vLLM's LLM takes dtype=torch.bfloat16; wkvm's took names only, and "AUTO" was refused where "BF16" passed."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)

    def run(dtype):
        out = LLM(model=tiny_pth, dtype=dtype).generate([[1, 2, 3]], params)[0]
        return out.token_ids, [next(iter(lp.values())) for lp in out.logprobs]

    assert run(torch.bfloat16) == run("BF16") != run("float32")  # bf16's rounding shows in the logprobs
    assert run("AUTO") == run(torch.float32) == run("float32")  # a .pth: auto is float32


def test_token_ids_beyond_the_vocabulary_are_refused_and_the_engine_goes_on(llm):
    """vLLM-user hunt (session 30): allowed_token_ids beyond the vocabulary failed an engine step and the LLM then
    spun forever on its next call; stop_token_ids and logit_bias beyond it were ignored in silence."""
    vocab = llm.model.vocab_size
    for param, value in [("allowed_token_ids", [vocab]), ("stop_token_ids", [vocab]), ("logit_bias", {vocab: 5})]:
        with pytest.raises(InvalidParam, match=f"{param}: {vocab}") as e:
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, **{param: value}))
        assert e.value.param == param
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert llm.generate([[1, 2]], greedy)[0].token_ids == greedy_reference(llm.model, [1, 2], 4)


def test_a_refused_prompt_leaves_none_of_its_call_queued(llm, monkeypatch):
    """Review of session 30: the vocabulary check ran as each prompt was queued, so a refused second prompt left the
    first queued, to run (300 steps) inside the next call. Refused before any is queued; a queue failure cancels."""
    vocab = llm.model.vocab_size
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    with pytest.raises(InvalidParam):
        llm.generate([[1, 2], [3, 4]], [long, SamplingParams(max_tokens=2, stop_token_ids=[vocab])])
    assert not llm.engine.scheduler.has_work
    submit = llm.engine.submit
    calls = []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("queue full")
        return submit(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "submit", second_fails)
    with pytest.raises(RuntimeError, match="queue full"):
        llm.generate([[1, 2], [3, 4]], long)
    assert not llm.engine.scheduler.has_work
    monkeypatch.undo()
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())
    assert len(llm.generate([[5]], SamplingParams(max_tokens=1))[0].token_ids) == 1 and len(steps) < 10


def test_a_failing_step_fails_the_batch_and_leaves_nothing_in_flight(llm, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(llm.engine, "step", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            llm.generate([[1, 2], [3]], SamplingParams(max_tokens=2))
    assert not llm.engine.scheduler.has_work  # failed, not left running: the next call had spun forever on them
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_vllm_prompt_forms_and_output_fields(world_pth):
    """vLLM's TextPrompt / TokensPrompt dicts, RequestOutput's prompt, request_id, finished and cumulative_logprob,
    generate's use_tqdm and priority, get_tokenizer; clear TypeErrors for what is not a prompt or params."""
    llm = LLM(model=world_pth)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    ids = llm.get_tokenizer().encode("Hi")
    outs = llm.generate([{"prompt": "Hi"}, {"prompt_token_ids": ids}, "Hi", ids], greedy, use_tqdm=True, priority=1)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["Hi", None, "Hi", None] and len({o.request_id for o in outs}) == 4
    o = outs[0]
    assert o.finished and o.outputs[0] is o and o.index == 0
    assert o.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)))
    assert o.cumulative_logprob < 0 and llm.generate("Hi", SamplingParams(max_tokens=2))[0].cumulative_logprob is None
    with pytest.raises(ValueError, match="'text' is not supported"):
        llm.generate([{"text": "Hi"}])
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):  # it had run the text alone
        llm.generate({"prompt": "Hi", "multi_modal_data": {"image": None}})
    with pytest.raises(TypeError, match="a prompt dict has 'prompt'"):
        llm.generate([{"prompt": 5}])
    with pytest.raises(TypeError, match="a prompt is a str"):
        llm.generate([3.5])
    with pytest.raises(TypeError, match="a prompt is a str"):
        llm.generate([[1.0, 2]])
    # numpy and torch integers (ids out of a tokenizer's return_tensors, or an array): they had been refused
    import numpy as np
    import torch

    arrays = [np.array(ids), [np.int64(t) for t in ids], {"prompt_token_ids": torch.tensor(ids)}]
    assert [llm.generate(a, greedy)[0].token_ids for a in arrays] == [outs[1].token_ids] * 3
    assert len(llm.generate([np.array(ids), torch.tensor(ids)], greedy)) == 2
    with pytest.raises(TypeError, match="sampling_params is a SamplingParams"):
        llm.generate(["Hi"], {"max_tokens": 2})
    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'gpu_memory_utilization'"):
        LLM(model=world_pth, gpu_memory_utilization=0.5)


def test_chat_answers_as_the_server_does(world_pth):
    """LLM.chat renders with the model's template and stops at the template's stop strings, as /v1/chat/completions."""
    from wkvm.chat_template import ChatTemplate

    llm = LLM(model=world_pth)
    llm.template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}assistant:",
                                stop=["\n\n"], name="test")  # fmt: skip
    messages = [{"role": "user", "content": "Hello"}]
    params = SamplingParams(max_tokens=40, temperature=0)
    out = llm.chat(messages, params)[0]
    text = "user: Hello\n\nassistant:"
    same = llm.generate([llm.tokenizer.encode(text)], SamplingParams(max_tokens=40, temperature=0, stop=["\n\n"]))[0]
    assert out.prompt == text and (out.text, out.token_ids) == (same.text, same.token_ids)
    assert [o.text for o in llm.chat([messages, messages], params)] == [out.text] * 2
    free = llm.chat(messages, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length"  # ignore_eos ignores the template's stops too, as the server


def test_a_request_that_masks_every_token_fails_greedy_or_sampled(llm):
    """allowed_token_ids whose only token min_tokens holds back leaves no token: greedy decoding fails as sampling
    does (hunt 13: greedy's argmax over -inf answered token 0, which the request did not allow)."""
    stop_id = llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0].token_ids[0]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=3, min_tokens=3, temperature=temperature, seed=1,
                                allowed_token_ids=[stop_id], stop_token_ids=[stop_id])  # fmt: skip
        out = llm.generate([[1, 2]], params)[0]
        assert out.finish_reason == "error" and out.token_ids == [] and out.error_code == "no_token_left", out
        assert "allowed_token_ids" in (out.error or "") and "min_tokens" in (out.error or ""), out.error


@pytest.mark.parametrize("k", [0, 1, 3])
def test_min_tokens_lets_a_stop_end_the_output_exactly_at_min_tokens(llm, k):
    """vLLM's min_tokens boundary: the first k tokens cannot end the output, token k + 1 can. With a stop token id,
    EOS or a stop string forced to come at every position, the output is exactly k other tokens then the stop (not
    k + 1 of them: an off-by-one held the stop back one token too long)."""
    eos = sorted(llm.tokenizer.eos_token_ids)[0]
    stop_id = 9 if eos != 9 else 10
    for forced, extra in ((stop_id, {"stop_token_ids": [stop_id]}), (eos, {})):
        p = SamplingParams(max_tokens=8, min_tokens=k, temperature=0, logit_bias={forced: 100.0}, **extra)
        out = llm.generate([[1, 2]], p)[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == k + 1, (forced, k, out.token_ids)
        assert out.token_ids[-1] == forced and forced not in out.token_ids[:k]
    (a,) = llm.tokenizer.encode("a")  # a stop string in every token's text: it stops from token k + 1 on
    p = SamplingParams(max_tokens=8, min_tokens=k, temperature=0, ignore_eos=True, logit_bias={a: 100.0}, stop=["a"])
    out = llm.generate([[1, 2]], p)[0]
    assert out.finish_reason == "stop" and out.token_ids == [a] * (k + 1) and out.text == "a" * k


class _BytesTokenizer:
    """A byte-level tokenizer stub for the Detokenizer: token i is the bytes given for it."""

    exact_bytes = True

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = [p.encode() for p in pieces]

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_that_begin_at_the_same_place_cut_at_the_longest(include):
    """Two stop strings that both end in the new text: the one that begins first wins (OpenAI's and vLLM's earliest
    match), and of two that begin at the same place, the longest: the text is cut before it, or ends with all of it
    under include_stop_str_in_output (never with the shorter one's part of it)."""
    from wkvm.engine.detokenizer import Detokenizer

    tok = _BytesTokenizer(["xabcd", "x", "abcd"])
    for stop in (["ab", "abc"], ["abc", "ab"], ["abc", "bc", "ab"]):
        for ids in ([0], [1, 2]):  # all in one token, or the stop strings all in the last one
            d = Detokenizer(tok, stop, include_stop=include)  # type: ignore[arg-type]
            assert [d.add(t) for t in ids][-1] and d.stopped, (stop, ids)
            assert d.text == ("xabc" if include else "x"), (stop, ids, d.text)
    d = Detokenizer(tok, ["bcd", "abc"], include_stop=include)  # type: ignore[arg-type]
    assert d.add(0) and d.text == ("xabc" if include else "x")  # "abc" begins first, though "bcd" is longer


def test_an_interrupted_generate_leaves_nothing_for_the_next_call(llm, monkeypatch):
    """Ctrl-C while a generate's requests ran had left them queued: the next call ran them all first (16 s for a
    4-token answer in the review's notebook case). They are cancelled now, as when submitting failed."""
    steps, original = [], llm.engine.step

    def step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return original()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2]] * 4, SamplingParams(max_tokens=500, ignore_eos=True))
    assert not llm.engine.scheduler.has_work
    monkeypatch.undo()
    alone = llm.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(alone.token_ids) == 3 and llm.engine.scheduler.has_work is False


def test_a_tokenizer_that_is_not_there_is_refused(tiny_pth, tmp_path):
    """LLM(tokenizer=...) naming no file (or a hub id) had silently run the family's default tokenizer instead."""
    for missing in ("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path):
        with pytest.raises(ValueError, match="never downloads"):
            LLM(model=tiny_pth, tokenizer=missing)


def test_seed_minus_one_draws_a_new_seed_as_vllms():
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_chat_takes_openai_shaped_messages_as_the_server_does():
    """vLLM's LLM.chat parses OpenAI messages before its template: text parts joined by newlines, no content as ""
    (an assistant's tool calls), a call's JSON-string arguments as an object. wkvm's had rendered a parts list's
    Python repr (SmolLM2's template raised a TypeError), "None", and arguments encoded twice."""
    from wkvm.chat_template import ChatTemplate, plain_messages

    llm = LLM()
    greedy = SamplingParams(max_tokens=4, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Good"}, {"type": "text", "text": "morrow."}]}]
    joined = [{"role": "user", "content": "Good\nmorrow."}]
    a, b = llm.chat(parts, greedy)[0], llm.chat(joined, greedy)[0]
    assert a.prompt == b.prompt and a.token_ids == b.token_ids and "'type'" not in a.prompt
    four = SamplingParams(max_tokens=4, temperature=0, stop=["x1", "x2", "x3", "x4"])  # the template adds one more
    assert llm.chat(joined, four)[0].text == b.text  # as the server: its stop is dropped (it had been a 400)
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Verona"}'}}
    history = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    (m,) = plain_messages(history)
    assert m["content"] == "" and m["tool_calls"][0]["function"]["arguments"] == {"city": "Verona"}
    template = ChatTemplate("{% for m in messages %}{{ m.content }}|{{ m.tool_calls[0].function.arguments | tojson }}"
                            "{% endfor %}")  # fmt: skip
    assert template.render(plain_messages(history), False) == '|{"city": "Verona"}'
