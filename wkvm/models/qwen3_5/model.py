"""Qwen3.5 text (and Qwen3-Next with dense MLPs): the forward pass, state explicit.

A decoder layer is a token mixer (for now only Gated DeltaNet, `linear_attention`) then a dense SwiGLU MLP, each
behind a pre-RMSNorm whose weight is stored zero-centred (the norm scales by 1 + w). State per GDN layer i:
`layers.{i}.conv` [2*Hk*dk + Hv*dv, K-1] (the last K-1 inputs of the causal conv, oldest first) and
`layers.{i}.delta` [Hv, dk, dv] (HF/fla axis order). Raw tensor names are the HF Qwen3.5 text names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from wkvm.models.family import (
    CheckpointError,
    ModelBase,
    RawTensors,
    compute_form,
    embedding_and_head,
    require,
    resident,
    rms_norm,
)
from wkvm.models.linear import linear
from wkvm.models.kv import Attn
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.qwen3_5.gated_delta import DEFAULT_CHUNK, gated_delta_chunked, gated_delta_step
from wkvm.models.spec import State, StateSpec, TensorSpec

FAMILY = "qwen3_5"
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
HYBRID_REFUSED = "hybrid attention layers are not supported yet (issue #17)"
L2_EPS = 1e-6  # fla's l2norm epsilon, as transformers uses it

EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# raw names under layer_prefix(i)
GDN_RAW = (
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
    "linear_attn.norm.weight", "linear_attn.out_proj.weight",
)  # fmt: skip
MLP_RAW = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
NORM_RAW = ("input_layernorm.weight", "post_attention_layernorm.weight")
# compute-form names of the matrices that go through `linear`
GDN_LINEAR = ("linear_attn.in_proj", "linear_attn.out_proj.weight")
MLP_LINEAR = ("mlp.gate_up", "mlp.down_proj.weight")


@dataclass(frozen=True)
class Qwen35Config:
    n_layer: int
    n_embd: int
    vocab_size: int
    ffn_size: int
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    layer_types: tuple[str, ...]
    tied_head: bool = False
    rms_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @staticmethod
    def from_checkpoint(raw: RawTensors, hf: dict[str, Any]) -> Qwen35Config:
        """Dimensions from the tensors; head counts (not recoverable from shapes alone) and eps from config.json
        (its text part). Layer kinds from the tensors: a layer with `self_attn.*` is full attention."""
        text = hf.get("text_config") or hf
        require(raw, [EMBED, FINAL_NORM], "Qwen3.5")
        vocab, embd = raw[EMBED].shape
        n_layer = 1 + max((int(k.split(".")[2]) for k in raw if k.startswith("model.layers.")), default=-1)
        kinds = tuple(
            FULL_ATTENTION if any(k.startswith(f"model.layers.{i}.self_attn.") for k in raw) else LINEAR_ATTENTION
            for i in range(n_layer)
        )
        declared = tuple(text.get("layer_types") or kinds)
        if FULL_ATTENTION in kinds or FULL_ATTENTION in declared:
            raise CheckpointError(HYBRID_REFUSED)
        if any(k.startswith("model.layers.") and ".mlp.experts." in k for k in raw):
            raise CheckpointError("mixture-of-experts MLP layers are not supported (dense MLP checkpoints only)")
        try:
            hk, hv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
            dk, dv = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
        except KeyError as e:
            raise CheckpointError(f"Qwen3.5 config.json lacks {e}") from None
        p = "model.layers.0."
        require(raw, [p + k for k in GDN_RAW + MLP_RAW + NORM_RAW], "Qwen3.5")
        conv = raw[p + "linear_attn.conv1d.weight"]
        cfg = Qwen35Config(
            n_layer=n_layer, n_embd=embd, vocab_size=vocab, ffn_size=raw[p + "mlp.gate_proj.weight"].shape[0],
            n_k_heads=hk, n_v_heads=hv, k_head_dim=dk, v_head_dim=dv, conv_kernel=conv.shape[-1], layer_types=kinds,
            tied_head=HEAD not in raw, rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        )  # fmt: skip
        if conv.shape[0] != cfg.conv_dim or raw[p + "linear_attn.A_log"].numel() != hv or hv % hk:
            raise CheckpointError(f"Qwen3.5 tensors do not fit the config's heads ({hk} key x {dk}, {hv} value x {dv})")
        return cfg


def state_spec(cfg: Qwen35Config) -> StateSpec:
    tensors: list[TensorSpec] = []
    for i, kind in enumerate(cfg.layer_types):
        if kind != LINEAR_ATTENTION:
            raise ValueError(HYBRID_REFUSED)
        tensors += [
            TensorSpec(f"layers.{i}.conv", (cfg.conv_dim, cfg.conv_kernel - 1), kind="conv"),
            TensorSpec(f"layers.{i}.delta", (cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim), kind="recurrent"),
        ]
    return StateSpec(FAMILY, tuple(tensors))


def global_keys(cfg: Qwen35Config) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def raw_layer_keys(cfg: Qwen35Config, i: int) -> tuple[str, ...]:
    if cfg.layer_types[i] != LINEAR_ATTENTION:
        raise CheckpointError(HYBRID_REFUSED)
    return GDN_RAW + MLP_RAW + NORM_RAW


def linear_keys(cfg: Qwen35Config, i: int) -> tuple[str, ...]:
    if cfg.layer_types[i] != LINEAR_ATTENTION:
        raise CheckpointError(HYBRID_REFUSED)
    return GDN_LINEAR + MLP_LINEAR


def used_tensors(raw: RawTensors, cfg: Qwen35Config) -> RawTensors:
    keys = set(global_keys(cfg))
    for i in range(cfg.n_layer):
        keys.update(f"model.layers.{i}.{k}" for k in raw_layer_keys(cfg, i))
    return {k: v for k, v in raw.items() if k in keys}


def prepare_layer(
    raw: RawTensors, i: int, cfg: Qwen35Config, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: the four input projections fused into one [out, in] matrix (q, k, v | z | b | a),
    gate and up fused, norms as 1 + w, the conv weight [D, K]; matrices in `dtype`, the rest fp32."""
    p = f"model.layers.{i}."
    keys = raw_layer_keys(cfg, i)
    require(raw, [p + k for k in keys], "Qwen3.5")
    r = {k: raw[p + k].to(device=device, dtype=torch.float32) for k in keys}
    t: Tensors = {
        "input_norm": 1.0 + r["input_layernorm.weight"],
        "post_norm": 1.0 + r["post_attention_layernorm.weight"],
        "linear_attn.in_proj": torch.cat([r[f"linear_attn.in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")]),
        "linear_attn.conv": r["linear_attn.conv1d.weight"].reshape(cfg.conv_dim, cfg.conv_kernel),
        "linear_attn.neg_A": -r["linear_attn.A_log"].exp(),
        "linear_attn.dt_bias": r["linear_attn.dt_bias"],
        "linear_attn.norm": r["linear_attn.norm.weight"],
        "linear_attn.out_proj.weight": r["linear_attn.out_proj.weight"],
        "mlp.gate_up": torch.cat([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
        "mlp.down_proj.weight": r["mlp.down_proj.weight"],
    }
    for k in linear_keys(cfg, i):
        t[k] = t[k].to(dtype)
    return compute_form(t, linear_keys(cfg, i), pack)


def prepare_globals(raw: RawTensors, cfg: Qwen35Config, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    """Embedding (in `dtype`), final norm (as 1 + w), head (prepacked; the embedding itself when tied)."""
    require(raw, global_keys(cfg), "Qwen3.5")
    embed, head = embedding_and_head(raw, EMBED, HEAD, cfg.tied_head, dtype, device)
    norm = 1.0 + raw[FINAL_NORM].to(device=device, dtype=torch.float32)
    return resident({EMBED: embed, "final_norm": norm, HEAD: head})


class Qwen35(ModelBase):
    family = FAMILY
    embed_key = EMBED
    config: Qwen35Config

    def __init__(self, cfg: Qwen35Config, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, state_spec(cfg), weights, model_fingerprint, device)
        self.delta_chunk = DEFAULT_CHUNK

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        eps = self.config.rms_eps
        x = x + self._gated_delta_net(i, w, rms_norm(x, w["input_norm"], eps), state)
        return x + self._mlp(w, rms_norm(x, w["post_norm"], eps))

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g["final_norm"], self.config.rms_eps), g[HEAD])

    # --- blocks --------------------------------------------------------------------------------
    def _gated_delta_net(self, i: int, w: Tensors, x: torch.Tensor, state: State) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        Hk, Hv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
        proj = linear(x, w["linear_attn.in_proj"])
        qkv, z, b, a = torch.split(proj, [cfg.conv_dim, cfg.value_dim, Hv, Hv], -1)
        qkv = F.silu(self._conv(w["linear_attn.conv"], qkv, state[f"layers.{i}.conv"]))
        q, k, v = torch.split(qkv, [cfg.key_dim, cfg.key_dim, cfg.value_dim], -1)
        q = q.reshape(B, T, Hk, dk)
        k = k.reshape(B, T, Hk, dk)
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2_EPS) * dk**-0.5
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2_EPS)
        if Hv != Hk:
            q, k = q.repeat_interleave(Hv // Hk, 2), k.repeat_interleave(Hv // Hk, 2)
        g = w["linear_attn.neg_A"] * F.softplus(a + w["linear_attn.dt_bias"])  # [B, T, Hv]
        beta = torch.sigmoid(b)
        S = state[f"layers.{i}.delta"].view(B * Hv, dk, dv)
        if T == 1:
            o = gated_delta_step(S, q.reshape(B * Hv, dk), k.reshape(B * Hv, dk), v.reshape(B * Hv, dv),
                                 g.reshape(B * Hv), beta.reshape(B * Hv))  # fmt: skip
        else:
            qh, kh, vh = (t.transpose(1, 2).reshape(B * Hv, T, -1) for t in (q, k, v.reshape(B, T, Hv, dv)))
            g, beta = (t.transpose(1, 2).reshape(B * Hv, T) for t in (g, beta))
            o = gated_delta_chunked(S, qh, kh, vh, g, beta, chunk=self.delta_chunk)
            o = o.view(B, Hv, T, dv).transpose(1, 2)
        o = rms_norm(o.reshape(B, T, Hv, dv), w["linear_attn.norm"], cfg.rms_eps)
        o = o * F.silu(z.reshape(B, T, Hv, dv))
        return linear(o.reshape(B, T, cfg.value_dim), w["linear_attn.out_proj.weight"])

    @staticmethod
    def _conv(weight: torch.Tensor, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv of x [B, T, D] continuing `window` [B, D, K-1] (updated in place); [B, T, D]."""
        T = x.shape[1]
        full = torch.cat([window, x.transpose(1, 2)], -1)  # [B, D, K-1+T]
        window.copy_(full[:, :, T:])
        if T == 1:
            return (full * weight).sum(-1).unsqueeze(1)
        return F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0]).transpose(1, 2)

    @staticmethod
    def _mlp(w: Tensors, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, w["mlp.gate_up"]).chunk(2, -1)
        return linear(F.silu(gate) * up, w["mlp.down_proj.weight"])
