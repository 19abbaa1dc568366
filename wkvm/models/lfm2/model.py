"""LFM2 (Liquid AI's hybrid of short gated convolutions and attention, HF `Lfm2ForCausalLM`): the forward pass,
state explicit.

A decoder layer is a token mixer then a SwiGLU MLP (`feed_forward.w1` gate, `w3` up, `w2` down), each behind a
pre-RMSNorm (`operator_norm`, `ffn_norm`); the model ends in an RMSNorm HF names `embedding_norm`. The mixer is a
short convolution (`conv`: in_proj gives B, C, x; the depthwise causal conv of B * x over the last K tokens, K = 3
in the released models, no activation; times C; out_proj) or grouped-query attention with RMSNorm per head on q
and k before RoPE over the whole head (`full_attention`). State per conv layer i: `layers.{i}.conv` [C, K-1], the
last K-1 values of B * x (kind "conv"); per attention layer i: `layers.{i}.k` / `layers.{i}.v`, one [Hkv, D] entry
per token (kind "kv", keys after RoPE). Raw tensor names are the HF LFM2 names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wkvm.models.family import (
    CheckpointError,
    ModelBase,
    RawTensors,
    check_dims,
    check_layer_count,
    check_shapes,
    compute_form,
    config_context,
    config_eps,
    embedding_and_head,
    layer_count,
    matrix_shape,
    only,
    positive_int,
    require,
    resident,
)
from wkvm.models.fused import add_rms_norm, rms_norm, silu_mul
from wkvm.models.kv import Attn, kv_tensors
from wkvm.models.linear import linear, stored
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.rope import frequencies
from wkvm.models.spec import State, StateSpec, TensorSpec

FAMILY = "lfm2"
CONV, ATTENTION = "conv", "full_attention"
PREFIX = "model.layers."
EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.embedding_norm.weight", "lm_head.weight"
CONV_RAW = ("conv.in_proj.weight", "conv.conv.weight", "conv.out_proj.weight")
ATTN_RAW = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.out_proj.weight", "self_attn.q_layernorm.weight", "self_attn.k_layernorm.weight")  # fmt: skip
MLP_RAW = ("feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight")
NORM_RAW = ("operator_norm.weight", "ffn_norm.weight")
CONV_BIASES = ("conv.in_proj.bias", "conv.conv.bias", "conv.out_proj.bias")
CONV_LINEAR = ("conv.in_proj.weight", "conv.out_proj.weight")
ATTN_LINEAR = ("self_attn.qkv", "self_attn.out_proj.weight")
MLP_LINEAR = ("mlp.gate_up", "mlp.down_proj.weight")


@dataclass(frozen=True)
class Lfm2Config:
    n_layer: int
    n_embd: int
    vocab_size: int
    ffn_size: int
    layer_types: tuple[str, ...]
    conv_size: int  # K: the conv spans the token and the K-1 before it
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 1000000.0
    tied_head: bool = True
    rms_eps: float = 1e-5
    max_context: int | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == ATTENTION)

    @staticmethod
    def from_checkpoint(raw: RawTensors, hf: dict[str, Any]) -> Lfm2Config:
        """Sizes from the tensors; heads, RoPE and eps from config.json (transformers' defaults where it is silent)."""
        require(raw, [EMBED, FINAL_NORM], "LFM2")
        vocab, embd = matrix_shape(raw, EMBED, "LFM2")
        n_layer = layer_count(raw, PREFIX)
        check_layer_count(hf, n_layer, "LFM2")
        kinds = tuple(ATTENTION if f"{PREFIX}{i}.self_attn.q_proj.weight" in raw else CONV for i in range(n_layer))
        declared = hf.get("layer_types")
        if declared is None:
            attn = hf.get("full_attn_idxs")
            declared = [ATTENTION if attn is None or i in attn else CONV for i in range(n_layer)]
        if tuple(declared) != kinds:
            raise CheckpointError(f"LFM2 config.json's layer kinds {list(declared)} do not match the tensors "
                                  f"({list(kinds)})")  # fmt: skip
        biases = [f"{PREFIX}{i}.{b}" for i in range(n_layer) for b in CONV_BIASES if f"{PREFIX}{i}.{b}" in raw]
        if hf.get("conv_bias") or biases:
            raise CheckpointError("LFM2 with conv_bias (biased short-conv projections) is not supported: the "
                                  "released models have none")  # fmt: skip
        for i, kind in enumerate(kinds):
            require(raw, [f"{PREFIX}{i}.{k}" for k in (CONV_RAW if kind == CONV else ATTN_RAW) + MLP_RAW + NORM_RAW],
                    "LFM2")  # fmt: skip
        # transformers' Lfm2Config defaults where config.json is silent (a head count of 1 there had passed the shape
        # checks, q being width x width either way, and run one head where transformers runs 32)
        heads = positive_int(hf, "num_attention_heads", "LFM2", default=32)
        kv_heads = positive_int(hf, "num_key_value_heads", "LFM2", default=8)
        head_dim = positive_int(hf, "head_dim", "LFM2", default=embd // heads)
        if heads % kv_heads:
            raise CheckpointError(f"LFM2 attention: {heads} heads over {kv_heads} key/value heads: not a shape "
                                  f"wkvm runs (config.json's num_attention_heads / num_key_value_heads)")  # fmt: skip
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})  # transformers' order
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type != "default":
            raise CheckpointError(f"LFM2 RoPE type {rope_type!r} is not supported (default only)")
        if head_dim % 2:
            raise CheckpointError(f"LFM2 attention heads of {head_dim} dims: RoPE needs an even number")
        ffn_key = f"{PREFIX}0.feed_forward.w1.weight"
        conv_layer = f"{PREFIX}{kinds.index(CONV)}.conv.conv.weight" if CONV in kinds else None
        check_dims(raw, {ffn_key: 2, **({conv_layer: 3} if conv_layer else {})}, "LFM2")
        conv_size = raw[conv_layer].shape[2] if conv_layer else int(hf.get("conv_L_cache") or 3)
        if conv_size < 2:
            raise CheckpointError(f"LFM2 short convolutions of {conv_size} taps: wkvm runs 2 or more")
        cfg = Lfm2Config(
            n_layer=n_layer, n_embd=embd, vocab_size=vocab, ffn_size=raw[ffn_key].shape[0], layer_types=kinds,
            conv_size=conv_size, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1000000.0))), tied_head=HEAD not in raw,
            rms_eps=config_eps(hf, "norm_eps", 1e-5, "LFM2"),
            max_context=config_context(hf, "max_position_embeddings", "LFM2"),
        )  # fmt: skip
        check_shapes(raw, expected_shapes(cfg), "LFM2")
        return cfg


def expected_shapes(cfg: Lfm2Config) -> dict[str, tuple[int, ...]]:
    """Every raw tensor's shape for `cfg` (HF's [out, in] matrices; the conv's [C, 1, K])."""
    c, q, kv, f, d = cfg.n_embd, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, c), HEAD: (cfg.vocab_size, c), FINAL_NORM: (c,)}
    attn = {"self_attn.q_proj.weight": (q, c), "self_attn.k_proj.weight": (kv, c), "self_attn.v_proj.weight": (kv, c),
            "self_attn.out_proj.weight": (c, q), "self_attn.q_layernorm.weight": (d,),
            "self_attn.k_layernorm.weight": (d,)}  # fmt: skip
    conv = {"conv.in_proj.weight": (3 * c, c), "conv.conv.weight": (c, 1, cfg.conv_size),
            "conv.out_proj.weight": (c, c)}  # fmt: skip
    rest = {"feed_forward.w1.weight": (f, c), "feed_forward.w3.weight": (f, c), "feed_forward.w2.weight": (c, f),
            "operator_norm.weight": (c,), "ffn_norm.weight": (c,)}  # fmt: skip
    for i, kind in enumerate(cfg.layer_types):
        p = f"{PREFIX}{i}."
        shapes.update({p + k: v for k, v in {**rest, **(attn if kind == ATTENTION else conv)}.items()})
    return shapes


def state_spec(cfg: Lfm2Config) -> StateSpec:
    tensors: list[TensorSpec] = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == ATTENTION:
            tensors += kv_tensors(i, cfg.n_kv_heads, cfg.head_dim)
        else:
            tensors.append(TensorSpec(f"layers.{i}.conv", (cfg.n_embd, cfg.conv_size - 1), kind="conv"))
    return StateSpec(FAMILY, tuple(tensors))


def global_keys(cfg: Lfm2Config) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def linear_keys(cfg: Lfm2Config, i: int) -> tuple[str, ...]:
    return (ATTN_LINEAR if cfg.layer_types[i] == ATTENTION else CONV_LINEAR) + MLP_LINEAR


def used_tensors(raw: RawTensors) -> RawTensors:
    keep = {EMBED, FINAL_NORM, HEAD}
    for i in range(layer_count(raw, PREFIX)):
        keep.update(f"{PREFIX}{i}.{k}" for k in CONV_RAW + CONV_BIASES + ATTN_RAW + MLP_RAW + NORM_RAW)
    return only(raw, keep)


def prepare_layer(
    raw: RawTensors, i: int, cfg: Lfm2Config, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: an attention layer's q, k, v fused, w1 and w3 fused; matrices in `dtype`, norms and
    the conv's taps fp32 (the taps [C, K])."""
    p = f"{PREFIX}{i}."
    require(raw, [p + k for k in MLP_RAW + NORM_RAW], "LFM2")
    f32 = {k: raw[p + k].to(device=device, dtype=torch.float32) for k in MLP_RAW + NORM_RAW}
    t: Tensors = {
        "operator_norm": f32["operator_norm.weight"],
        "ffn_norm": f32["ffn_norm.weight"],
        "mlp.gate_up": stored(torch.cat([f32["feed_forward.w1.weight"], f32["feed_forward.w3.weight"]]), dtype),
        "mlp.down_proj.weight": stored(f32["feed_forward.w2.weight"], dtype),
    }
    if cfg.layer_types[i] == ATTENTION:
        require(raw, [p + k for k in ATTN_RAW], "LFM2")
        t["self_attn.qkv"] = stored(torch.cat([raw[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]).to(device), dtype)
        t["self_attn.out_proj.weight"] = stored(raw[p + "self_attn.out_proj.weight"].to(device), dtype)
        for x in "qk":
            t[f"self_attn.{x}_norm"] = raw[f"{p}self_attn.{x}_layernorm.weight"].to(device=device, dtype=torch.float32)
    else:
        require(raw, [p + k for k in CONV_RAW], "LFM2")
        t["conv.in_proj.weight"] = stored(raw[p + "conv.in_proj.weight"].to(device), dtype)
        t["conv.out_proj.weight"] = stored(raw[p + "conv.out_proj.weight"].to(device), dtype)
        taps = raw[p + "conv.conv.weight"].to(device=device, dtype=torch.float32)
        t["conv.taps"] = taps.reshape(taps.shape[0], taps.shape[2]).contiguous()
    return compute_form(t, linear_keys(cfg, i), pack)


def prepare_globals(raw: RawTensors, cfg: Lfm2Config, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    require(raw, global_keys(cfg), "LFM2")
    embed, head = embedding_and_head(raw, EMBED, HEAD, cfg.tied_head, dtype, device)
    return resident({EMBED: embed, "final_norm": raw[FINAL_NORM].to(device=device, dtype=torch.float32), HEAD: head})


def short_conv(x: torch.Tensor, window: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The depthwise causal conv of x [B, T, C] after `window` [B, C, K-1] (the last K-1 inputs, oldest first;
    advanced in place) with taps [C, K], no activation -> [B, T, C]. Each output is the same products added in the
    same order whatever T is (elementwise ops), so a chunk has stepping's bits; K is 3 in the released models, so
    the K shifted multiply-adds cost less than a conv call."""
    T, K = x.shape[1], taps.shape[1]
    full = torch.cat([window.transpose(1, 2), x], 1)  # [B, K-1+T, C], token-major
    window.copy_(full[:, T:].transpose(1, 2))
    out = full[:, :T] * taps[:, 0]
    for k in range(1, K):
        out += full[:, k : k + T] * taps[:, k]
    return out


class Lfm2(ModelBase):
    family = FAMILY
    embed_key = EMBED
    config: Lfm2Config

    def __init__(self, cfg: Lfm2Config, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, state_spec(cfg), weights, model_fingerprint, device)
        self.kv_layers = cfg.attention_layers
        self.inv_freq = frequencies(cfg.rope_theta, cfg.head_dim).to(self.device)

    # norms, the conv's taps, gates, SiLU and residuals work row by row: the matmuls and attention decide
    row_keys = CONV_LINEAR + ATTN_LINEAR + MLP_LINEAR

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g["final_norm"], self.config.rms_eps), g[HEAD])

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        eps = self.config.rms_eps
        h = rms_norm(x, w["operator_norm"], eps)
        if attn is not None and i in self.kv_layers:
            h = self._attention(i, w, h, attn)
        else:
            b, c, v = linear(h, w["conv.in_proj.weight"]).chunk(3, -1)
            h = linear(c * short_conv(b * v, state[f"layers.{i}.conv"], w["conv.taps"]), w["conv.out_proj.weight"])
        x, h = add_rms_norm(x, h, w["ffn_norm"], eps)
        return x + linear(silu_mul(linear(h, w["mlp.gate_up"])), w["mlp.down_proj.weight"])

    def _attention(self, i: int, w: Tensors, x: torch.Tensor, attn: Attn) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = torch.split(linear(x, w["self_attn.qkv"]), [H * D, Hkv * D, Hkv * D], -1)
        q = rms_norm(q.reshape(B, T, H, D), w["self_attn.q_norm"], cfg.rms_eps)
        k = rms_norm(k.reshape(B, T, Hkv, D), w["self_attn.k_norm"], cfg.rms_eps)
        o = attn.rope_attend(i, q, k, v.reshape(B, T, Hkv, D), D**-0.5)
        return linear(o.reshape(B, T, H * D), w["self_attn.out_proj.weight"])
