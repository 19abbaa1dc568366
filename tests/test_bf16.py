"""bf16 weights (`dtype="bfloat16"`): the six large matrices, embedding and head are stored in bf16; all other
tensors, the state and the arithmetic stay fp32. Judged against BlinkDL's `rwkv` package on the trained default
model: our bf16 must stay closer to the fp32 reference than the package's own bf16 path does."""

import logging

import pytest
import torch
from conftest import greedy_reference

from wkvm import LLM, SamplingParams
from wkvm.cli import EMBEDDED_MODEL
from wkvm.models.rwkv7.checkpoint import read_checkpoint, write_pth
from wkvm.tokenizer import load_tokenizer
from wkvm.weights.loader import load_model

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\nJULIET:\n"


@pytest.fixture(scope="module")
def trained_pth(tmp_path_factory):
    path = tmp_path_factory.mktemp("trained") / "tiny.pth"
    write_pth(read_checkpoint(EMBEDDED_MODEL)[0], path)
    return path


@pytest.fixture(scope="module")
def ids():
    return load_tokenizer(EMBEDDED_MODEL).encode(TEXT)


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position, in nats."""
    p, q = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def test_bf16_is_closer_to_fp32_than_the_reference_packages_bf16(trained_pth, ids):
    from rwkv.model import RWKV

    ref32, _ = RWKV(str(trained_pth).removesuffix(".pth"), "cpu fp32").forward(ids, None, full_output=True)
    ref16, _ = RWKV(str(trained_pth).removesuffix(".pth"), "cpu bf16").forward(ids, None, full_output=True)
    ours16 = load_model(trained_pth, dtype="bfloat16").prefill(ids, all_logits=True)[0]
    ours32 = load_model(trained_pth).prefill(ids, all_logits=True)[0]
    assert kl(ref32, ours32).max() < 1e-5  # the fp32 path is the reference
    ours, theirs = kl(ref32, ours16).mean(), kl(ref32, ref16).mean()
    assert ours <= theirs, (ours, theirs)
    assert ours < 2e-3
    assert (ours16.argmax(-1) == ref32.argmax(-1)).float().mean() >= 0.9


def test_bf16_decode_matches_its_prefill_and_the_engine(trained_pth, ids):
    """Step-by-step decode equals the chunked prefill in bf16 too, and the engine reproduces plain greedy."""
    model = load_model(trained_pth, dtype="bfloat16")
    whole = model.prefill(ids, all_logits=True)[0]
    state = model.new_state()
    steps = torch.stack([model.decode([t], state)[0] for t in ids])
    assert kl(whole, steps).max() < 1e-3  # logits come out of bf16 matmuls: equal to bf16 rounding, not bitwise
    want = greedy_reference(model, ids, 16)
    out = LLM(model=trained_pth, dtype="bfloat16").generate([ids], SamplingParams(max_tokens=16, temperature=0,
                                                                                  ignore_eos=True))[0]  # fmt: skip
    assert out.token_ids == want


def test_bf16_weights_take_half_the_memory(trained_pth):
    def weight_bytes(model) -> int:
        w = model.weights
        tensors = [*w.globals().values(), *(t for i in range(model.config.n_layer) for t in w.layer(i).values())]
        return sum(torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else t.numel() * t.element_size() for t in tensors)

    full, half = weight_bytes(load_model(trained_pth)), weight_bytes(load_model(trained_pth, dtype="bfloat16"))
    assert 0.45 < half / full < 0.6  # the small vectors and LoRA matrices stay fp32


def test_bf16_streaming_equals_bf16_resident(trained_pth, ids, tmp_path):
    """With oneDNN's bf16 kernel, layers stream from a bf16 blocked copy beside the fp32 pack; without it (e.g. an
    AVX2-only CPU) from the pack's plain files. The output equals resident bf16 either way."""
    from wkvm.models.linear import onednn_bf16_available
    from wkvm.weights.pack import write_pack

    write_pack(trained_pth, tmp_path / "pack")
    want = load_model(trained_pth, dtype="bfloat16").prefill(ids, all_logits=True)[0]
    streamed = load_model(tmp_path / "pack", dtype="bfloat16", weight_cache_layers=2)
    got = streamed.prefill(ids, all_logits=True)[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert streamed.weights.blocked == onednn_bf16_available()
    assert len(list((tmp_path / "pack").glob("onednn-*"))) == int(onednn_bf16_available())
    streamed.weights.close()


@pytest.mark.parametrize("native", [True, False])
def test_bf16_without_a_native_kernel_warns_at_load(trained_pth, monkeypatch, caplog, native):
    """Without a native bf16 kernel (AVX2-only or plain AVX-512 CPUs) bf16 is slower than fp32: say so at load."""
    from wkvm.models import linear

    monkeypatch.setattr(linear, "bf16_native", lambda: native)
    with caplog.at_level(logging.WARNING, logger="wkvm.weights.loader"):
        load_model(trained_pth, dtype="bfloat16")
        load_model(trained_pth)  # float32 never warns
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "bf16" in r.getMessage()]
    if native:
        assert warnings == [] and "faster" in linear.bf16_speed()
    else:
        (message,) = warnings
        assert "no native bf16 kernel" in message and "slower than float32" in message
        assert "use --dtype float32" in message


def test_unknown_dtype_is_a_clear_error(trained_pth):
    with pytest.raises(ValueError, match="use float32, bfloat16, int8, int4 or auto"):
        load_model(trained_pth, dtype="float16")


def test_server_serves_bf16_and_answers_like_the_python_api(trained_pth, ids):
    import openai
    from live_server import LiveServer

    want = LLM(model=trained_pth, dtype="bfloat16").generate([ids], SamplingParams(max_tokens=12, temperature=0,
                                                                                   ignore_eos=True))[0]  # fmt: skip
    with LiveServer(model=str(trained_pth), dtype="bf16") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    with pytest.raises(ValueError, match="use float32, bfloat16, int8, int4 or auto"):  # auto: the file's own
        LiveServer(model=str(trained_pth), dtype="int2")


def test_a_plain_bf16_weight_widened_for_many_rows_gives_the_bf16_product():
    """Where oneDNN has no bf16 kernel (AVX2) bf16 weights stay plain; from `BF16_WIDEN_ROWS` rows `linear` widens
    them to fp32 for the call (ATen's bf16 GEMM was 2-5x slower there): the same product as row by row (x rounded to
    bf16, fp32 accumulation, the result rounded to bf16)."""
    from wkvm.models import linear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g).bfloat16()
    x = torch.randn(linear.BF16_WIDEN_ROWS + 3, 80, generator=g)
    many = linear.linear(x, w)
    one_by_one = torch.cat([linear.linear(x[i : i + 1], w) for i in range(len(x))])
    exact = (x.bfloat16().double() @ w.double().T).float()
    assert many.dtype == torch.float32 and torch.equal(many, many.bfloat16().float())  # rounded to bf16
    torch.testing.assert_close(many, exact, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(many, one_by_one, rtol=2**-7, atol=1e-5)
