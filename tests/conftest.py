import logging
import os

os.environ["RWKV_V7_ON"] = "1"  # BlinkDL's `rwkv` package reads this at import
os.environ.setdefault("RWKV_CUDA_ON", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from wkvm.models.rwkv7.random_weights import RWKV7Shape, save_random_rwkv7  # noqa: E402

# Shapes for the exactness tests: H >= 3, L >= 3, four unequal LoRA ranks, V = 65536 and small V.
SHAPES = {
    "L3-C96-H3-V300": RWKV7Shape(3, 96, 32, 300, None, 8, 12, 4, 16),
    "L4-C128-H4-V65536": RWKV7Shape(4, 128, 32, 65536, 384, 16, 8, 12, 24),
    "L2-C64-H4-V97-F200": RWKV7Shape(2, 64, 16, 97, 200, 4, 6, 2, 10),
    "L3-C192-H3-N64-V1000": RWKV7Shape(3, 192, 64, 1000, None, 32, 16, 8, 48),
}
TINY = RWKV7Shape(2, 64, 16, 256, None, 8, 8, 4, 16)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def tiny_pth(ckpt_dir):
    path = ckpt_dir / "tiny.pth"
    save_random_rwkv7(path, TINY, seed=7)
    return path


@pytest.fixture(scope="session")
def tiny_hf(ckpt_dir):
    path = ckpt_dir / "tiny-hf"
    save_random_rwkv7(path, TINY, seed=7, fmt="hf")
    return path


def reference_model(pth_path):
    """BlinkDL's `rwkv` package (strategy cpu fp32): the oracle for RWKV-7 exactness."""
    from rwkv.model import RWKV

    return RWKV(str(pth_path).removesuffix(".pth"), "cpu fp32")


@pytest.fixture(scope="session")
def world_pth(ckpt_dir):
    """A small model with the World vocabulary (65536), so text prompts work."""
    path = ckpt_dir / "world.pth"
    save_random_rwkv7(path, RWKV7Shape(2, 32, 16, 65536, None, 8, 8, 4, 8), seed=3)
    return path


CHAR_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


CHAR_VOCAB = {chr(c): i for i, c in enumerate(range(0x21, 0x7F))}


def write_char_tokenizer(path):
    """tokenizer.json over 94 printable, non-space ASCII characters, one token each, and a space-free chat
    template, in model directory `path`: any token sequence retokenizes to itself, so chat continuity can be exact."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab=CHAR_VOCAB, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(CHAR_TEMPLATE)


@pytest.fixture(scope="session")
def char_model(ckpt_dir):
    """A random RWKV-7 model with the char tokenizer (write_char_tokenizer)."""
    path = ckpt_dir / "char-model"
    save_random_rwkv7(path, RWKV7Shape(2, 32, 16, len(CHAR_VOCAB), None, 8, 8, 4, 8), seed=11, fmt="hf")
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reuse(char_model, tmp_path_factory):
    """A live server on the char model with state reuse on (chat continuity, Open WebUI tests); one per module."""
    from live_server import LiveServer

    with LiveServer(model=str(char_model), slots=4, state_dir=str(tmp_path_factory.mktemp("reuse"))) as s:
        yield s


@pytest.fixture(scope="module")
def fresh(char_model):
    """The same without any reuse: the oracle every reused answer must equal."""
    from live_server import LiveServer

    with LiveServer(model=str(char_model), slots=4, prefix_reuse=False) as s:
        yield s


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a test module of tiny models: their matrices gain nothing from threads, and on a busy
    machine OpenMP threads wait on each other (5x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def ids_for(vocab: int, batch: int, length: int, seed: int = 0):
    """Random token ids [batch, length], the same for a seed."""
    import torch

    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_reference(model, prompt, n):
    """Greedy tokens from a plain prefill + decode loop: the 'alone' run engine outputs must equal."""
    import torch

    logits, state = model.prefill(prompt)
    out = []
    for _ in range(n):
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits = model.decode([tok], state)[0]
    return out


SERVER_ERROR_LOGGERS = ("wkvm.server", "wkvm.engine")


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_server_errors(request):
    """Every test: no 5xx answered and no engine step failure logged by an in-process server, unless the test is
    marked `allows_5xx` (e.g. a 503 while the model loads). A 5xx is a bug."""
    handler = _ErrorRecords()
    loggers = [logging.getLogger(name) for name in SERVER_ERROR_LOGGERS]
    for lg in loggers:
        lg.addHandler(handler)
    yield
    for lg in loggers:
        lg.removeHandler(handler)
    if request.node.get_closest_marker("allows_5xx") is None:
        assert not handler.records, "server errors logged: " + "; ".join(r.getMessage() for r in handler.records)


def pytest_configure(config):
    config.addinivalue_line("markers", "allows_5xx: the test expects the server to answer a 5xx (e.g. 503 loading)")


def x_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 / int4 kernels see it, written from x_groups.h's contract in torch: per group of 32 along K,
    scale = max|x| / 127 and q = x * (127 / max|x|) rounded to nearest, ties to even (float32 operations, so the same
    integers)."""
    m, k = x.shape
    g = -(-k // 32) * 32
    padded = torch.zeros(m, g)
    padded[:, :k] = x
    groups = padded.view(m, -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round((groups * inv).clamp(-127, 127))
    return (q.double() * (amax / 127).double()).view(m, g)[:, :k]
