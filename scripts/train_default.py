"""Train wkvm's embedded default model: a small RWKV-7 on tinyshakespeare, on CPU, in well under 45 minutes.

    python scripts/train_default.py --minutes 28   # writes wkvm/assets/wkvm-tiny-shakespeare

Writes an HF/fla-format directory (config.json, model.safetensors, tokenizer.json, chat template) that wkvm
loads, checks that wkvm's inference reproduces the training forward pass, and prints the held-out loss.
The training forward below is the same RWKV-7 as wkvm/models/rwkv7.py, written without in-place state
updates so autograd can run through it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wkvm.models.rwkv7.checkpoint import write_hf  # noqa: E402

DECAY_SCALE = 0.606531
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}JULIET:\n{% elif m.role == 'user' %}ROMEO:\n{% else %}{% endif %}"
    "{% if m.role in ('user', 'assistant') %}{{ m.content | trim }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}JULIET:\n{% endif %}"
)


def wkv(r, log_w, k, v, a, b, chunk: int = 16):
    """The RWKV-7 recurrence from a zero state over [BH, T, N] inputs, in chunks, without in-place updates."""
    BH, T, N = r.shape
    S = r.new_zeros(BH, N, N)
    outs = []
    for s in range(0, T, chunk):
        rc, lw, kc, vc, ac, bc = (x[:, s : s + chunk] for x in (r, log_w, k, v, a, b))
        n = rc.shape[1]
        g = lw.cumsum(1)
        a_dec, r_dec, inv = ac * torch.exp(g - lw), rc * torch.exp(g), torch.exp(-g)
        strict = torch.ones(n, n, dtype=torch.bool).tril(-1)
        causal = torch.ones(n, n, dtype=torch.bool).tril(0)
        A_ab = (a_dec @ (bc * inv).transpose(1, 2)) * strict
        A_ak = (a_dec @ (kc * inv).transpose(1, 2)) * strict
        A_rb = (r_dec @ (bc * inv).transpose(1, 2)) * causal
        A_rk = (r_dec @ (kc * inv).transpose(1, 2)) * causal
        ST = S.transpose(1, 2)
        U = torch.linalg.solve_triangular(torch.eye(n) - A_ab, a_dec @ ST + A_ak @ vc, upper=False, unitriangular=True)
        outs.append(r_dec @ ST + A_rb @ U + A_rk @ vc)
        to_end = torch.exp(g[:, -1:] - g)
        S = S * torch.exp(g[:, -1:]) + U.transpose(1, 2) @ (bc * to_end) + vc.transpose(1, 2) @ (kc * to_end)
    return torch.cat(outs, 1)


def ortho(shape, gain):
    w = torch.empty(shape)
    nn.init.orthogonal_(w, gain=gain)
    return w


class TimeMix(nn.Module):
    def __init__(self, i: int, L: int, C: int, N: int, ranks: dict[str, int]):
        super().__init__()
        self.i, self.H, self.N = i, C // N, N
        r0, r1 = i / max(L - 1, 1), 1 - i / L
        ddd = (torch.arange(C) / C).view(1, 1, C)
        n = torch.arange(C, dtype=torch.float)
        linear = n / (C - 1) - 0.5
        zig = ((n % N) - (N - 1) / 2) / ((N - 1) / 2)
        zig = zig * zig.abs()
        www = -6 + 6 * (n / (C - 1)) ** (1 + r0**0.3)
        for name, p in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9), ("x_g", 0.2)):
            setattr(self, name, nn.Parameter(1 - ddd ** (p * r1)))
        vec = lambda t: nn.Parameter(t.view(1, 1, C).clone())  # noqa: E731
        self.w0, self.a0 = vec(www + 0.5 + zig * 2.5), vec(-0.19 + zig * 0.3 + linear * 0.4)
        self.w1, self.w2 = nn.Parameter(torch.zeros(C, ranks["w"])), nn.Parameter(ortho((ranks["w"], C), 0.1))
        self.a1, self.a2 = nn.Parameter(torch.zeros(C, ranks["a"])), nn.Parameter(ortho((ranks["a"], C), 0.1))
        if i > 0:
            self.v0 = vec(0.73 - linear * 0.4)
            self.v1, self.v2 = nn.Parameter(torch.zeros(C, ranks["v"])), nn.Parameter(ortho((ranks["v"], C), 0.1))
        self.g1, self.g2 = nn.Parameter(torch.zeros(C, ranks["g"])), nn.Parameter(ortho((ranks["g"], C), 0.1))
        self.k_k, self.k_a = vec(0.71 - linear * 0.1), vec(torch.full((C,), 1.02))
        self.r_k = nn.Parameter(torch.full((self.H, N), -0.04))
        self.receptance, self.key, self.value, self.output = (nn.Linear(C, C, bias=False) for _ in range(4))
        bound = C**-0.5
        nn.init.uniform_(self.receptance.weight, -0.5 * bound, 0.5 * bound)
        nn.init.uniform_(self.key.weight, -0.05 * bound, 0.05 * bound)
        nn.init.uniform_(self.value.weight, -0.5 * bound, 0.5 * bound)
        nn.init.zeros_(self.output.weight)
        self.ln_x = nn.GroupNorm(self.H, C, eps=64e-5)
        with torch.no_grad():
            self.ln_x.weight.fill_(((i + 1) / L) ** 0.7)

    def forward(self, x, v_first):
        B, T, C = x.shape
        H, N = self.H, self.N
        dx = F.pad(x, (0, 0, 1, -1)) - x
        xr, xw, xk, xv, xa, xg = (x + dx * m for m in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g))
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)
        log_w = torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2) * -DECAY_SCALE
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1).view(B, T, C)
        k = k * (1 + (a - 1) * self.k_a)
        if self.i == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)
        heads = [t.view(B, T, H, N).transpose(1, 2).reshape(B * H, T, N) for t in (r, log_w, k, v, -kk, kk * a)]
        o = wkv(*heads).view(B, H, T, N).transpose(1, 2).reshape(B * T, C)
        o = self.ln_x(o).view(B, T, C)
        o = o + ((r * k).view(B, T, H, N) * self.r_k).sum(-1, keepdim=True).mul(v.view(B, T, H, N)).view(B, T, C)
        return self.output(o * g), v_first


class ChannelMix(nn.Module):
    def __init__(self, i: int, L: int, C: int, F_: int):
        super().__init__()
        self.x_k = nn.Parameter(1 - (torch.arange(C) / C).view(1, 1, C) ** ((1 - i / L) ** 4))
        self.key, self.value = nn.Linear(C, F_, bias=False), nn.Linear(F_, C, bias=False)
        nn.init.uniform_(self.key.weight, -(C**-0.5), C**-0.5)
        nn.init.zeros_(self.value.weight)

    def forward(self, x):
        k = x + (F.pad(x, (0, 0, 1, -1)) - x) * self.x_k
        return self.value(torch.relu(self.key(k)) ** 2)


class Block(nn.Module):
    def __init__(self, i, L, C, N, F_, ranks):
        super().__init__()
        if i == 0:
            self.ln0 = nn.LayerNorm(C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.att, self.ffn = TimeMix(i, L, C, N, ranks), ChannelMix(i, L, C, F_)

    def forward(self, x, v_first):
        if hasattr(self, "ln0"):
            x = self.ln0(x)
        a, v_first = self.att(self.ln1(x), v_first)
        x = x + a
        return x + self.ffn(self.ln2(x)), v_first


class RWKV7Train(nn.Module):
    def __init__(self, V, L, C, N, F_, ranks):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        nn.init.uniform_(self.emb.weight, -1e-4, 1e-4)
        self.blocks = nn.ModuleList(Block(i, L, C, N, F_, ranks) for i in range(L))
        self.ln_out = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(ortho((V, C), 0.5 * math.sqrt(V / C)))

    def forward(self, idx):
        x, v_first = self.emb(idx), None
        for blk in self.blocks:
            x, v_first = blk(x, v_first)
        return self.head(self.ln_out(x))


def train_tokenizer(text: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator([text], trainer)
    return tok


@torch.no_grad()
def evaluate(model, data: torch.Tensor, T: int, batch: int) -> float:
    """Mean cross-entropy (nats per token) over the held-out tokens, in non-overlapping windows."""
    model.eval()
    n = (len(data) - 1) // T
    total, count = 0.0, 0
    for s in range(0, n, batch):
        idx = torch.stack([data[j * T : j * T + T] for j in range(s, min(s + batch, n))])
        tgt = torch.stack([data[j * T + 1 : j * T + T + 1] for j in range(s, min(s + batch, n))])
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten(), reduction="sum")
        total, count = total + loss.item(), count + tgt.numel()
    model.train()
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--out", default=str(ROOT / "wkvm" / "assets" / "wkvm-tiny-shakespeare"))
    ap.add_argument("--minutes", type=float, default=30.0, help="training time budget (tokenizer and eval extra)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(args.seed)
    text = Path(args.data).read_text(encoding="utf-8")
    split = int(len(text) * 0.9)
    split = text.rfind("\n\n", 0, split) + 2  # cut between speeches
    train_text, val_text = text[:split], text[split:]
    tok = train_tokenizer(train_text, args.vocab)
    train = torch.tensor(tok.encode(train_text).ids)
    val = torch.tensor(tok.encode(val_text).ids)
    V, C, L, N = tok.get_vocab_size(), args.width, args.layers, args.head_size
    ranks = {"w": 32, "a": 32, "v": 16, "g": 64}
    model = RWKV7Train(V, L, C, N, 4 * C, ranks)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokens: train {len(train)}, val {len(val)}; vocab {V}; params {n_params / 1e6:.2f}M", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "emb" not in name and "r_k" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99), eps=1e-8)  # fmt: skip
    budget = args.minutes * 60
    t0, step, warmup = time.time(), 0, 30
    best = (float("inf"), None, 0)  # held-out loss, weights, step: keep the best (early stopping)
    gen = torch.Generator().manual_seed(args.seed)
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=int(budget), unit="s", desc="training", leave=False)
    while time.time() - t0 < budget:
        if bar is not None:
            bar.update(int(time.time() - t0) - bar.n)
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ix = torch.randint(0, len(train) - args.ctx - 1, (args.batch,), generator=gen)
        idx = torch.stack([train[i : i + args.ctx] for i in ix])
        tgt = torch.stack([train[i + 1 : i + args.ctx + 1] for i in ix])
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step} {time.time() - t0:6.0f}s lr {lr:.2e} loss {loss.item():.3f}", flush=True)
        if step % args.eval_every == 0:
            v = evaluate(model, val, args.ctx, 32)
            print(f"step {step} held-out {v:.4f} nats/token", flush=True)
            if v < best[0]:
                best = (v, {k: t.detach().clone() for k, t in model.state_dict().items()}, step)

    val_nats_tok = evaluate(model, val, args.ctx, 32)
    if best[1] is not None and best[0] < val_nats_tok:
        model.load_state_dict(best[1])
        val_nats_tok = best[0]
        print(f"keeping the step-{best[2]} weights (lower held-out loss)", flush=True)
    nats_char = val_nats_tok * len(val) / len(val_text)
    print(f"held-out: {val_nats_tok:.4f} nats/token, {nats_char:.4f} nats/char", flush=True)

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    raw = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    write_hf(raw, out)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "chat_template.json").write_text(json.dumps({"name": "shakespeare-dialogue", "stop": ["\n\n"]}) + "\n")

    from wkvm.weights.loader import load_model

    loaded = load_model(out)
    sample = val[:200]
    with torch.no_grad():
        ref = model.eval()(sample.view(1, -1))[0]
    got, _ = loaded.prefill(sample.tolist(), all_logits=True)
    diff = (ref - got).abs().max().item()
    print(f"wkvm inference vs training forward: max |logit diff| = {diff:.2e}", flush=True)
    assert diff < 1e-3, "exported model does not reproduce the training forward"
    info = {
        "seed": args.seed, "minutes_budget": args.minutes, "steps": step, "params": n_params,
        "train_tokens_seen": step * args.batch * args.ctx, "best_step": best[2] or step,
        "vocab": V, "layers": L, "width": C,
        "head_size": N, "ctx": args.ctx, "batch": args.batch, "lr": args.lr,
        "val_nats_per_token": round(val_nats_tok, 4), "val_nats_per_char": round(nats_char, 4),
        "wall_seconds": round(time.time() - t_start, 1), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
