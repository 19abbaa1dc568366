"""Qwen3.5 text (and Qwen3-Next with dense MLPs): the forward pass, state explicit.

A decoder layer is a token mixer then a dense SwiGLU MLP, each behind a pre-RMSNorm whose weight is stored
zero-centred (the norm scales by 1 + w). The mixer is Gated DeltaNet (`linear_attention`) or gated full attention
(`full_attention`: grouped-query attention whose q projection also gives a per-head output gate, q/k RMSNorm per
head, RoPE on the first `rotary_dim` dims of each head), typically 3:1. State per GDN layer i: `layers.{i}.conv`
[2*Hk*dk + Hv*dv, K-1] (the last K-1 inputs of the causal conv, oldest first) and `layers.{i}.delta` [Hv, dk, dv]
(HF/fla axis order); per attention layer i: `layers.{i}.k` / `layers.{i}.v`, one [Hkv, D] entry per token (kind
"kv", keys after RoPE). Raw tensor names are the HF Qwen3.5 text names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from wkvm.models.causal_conv import causal_conv_silu
from wkvm.models.family import (
    CheckpointError,
    ModelBase,
    RawTensors,
    check_dims,
    check_layer_count,
    check_shapes,
    check_silu,
    compute_form,
    config_context,
    config_eps,
    embedding_and_head,
    matrix_shape,
    only,
    positive_int,
    require,
    resident,
    shape_of,
)
from wkvm.models.fused import add_rms_norm, rms_norm, silu_mul
from wkvm.models.kv import Attn, kv_tensors
from wkvm.models.linear import linear, stored
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.qwen3_5.gated_delta import (
    DEFAULT_CHUNK,
    gated_delta_chunked,
    gated_delta_step,
    kernel_available,
    layer_steps,
)
from wkvm.models.rope import frequencies
from wkvm.models.spec import State, StateSpec, TensorSpec

FAMILY = "qwen3_5"
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
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
ATTN_RAW = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
)  # fmt: skip
# compute-form names of the matrices that go through `linear`
GDN_LINEAR = ("linear_attn.in_proj", "linear_attn.out_proj.weight")
ATTN_LINEAR = ("self_attn.qkv", "self_attn.o_proj.weight")
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
    # full-attention layers (0 when there are none)
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    rotary_dim: int = 0  # head_dim x partial_rotary_factor: RoPE turns the first rotary_dim dims of each head
    rope_theta: float = 10000.0
    max_context: int | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

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
        text = text_part(hf)
        require(raw, [EMBED, FINAL_NORM], "Qwen3.5")
        vocab, embd = matrix_shape(raw, EMBED, "Qwen3.5")
        n_layer = 1 + max((int(k.split(".")[2]) for k in raw if k.startswith("model.layers.")), default=-1)
        kinds = tuple(
            FULL_ATTENTION if any(k.startswith(f"model.layers.{i}.self_attn.") for k in raw) else LINEAR_ATTENTION
            for i in range(n_layer)
        )
        check_layer_count(text, n_layer, "Qwen3.5")
        check_silu(text, "Qwen3.5")
        declared = tuple(text.get("layer_types") or derived_layer_types(text, n_layer))
        if declared != kinds:
            raise CheckpointError(f"Qwen3.5 config.json's layer_types {list(declared)} do not match the tensors "
                                  f"({list(kinds)})")  # fmt: skip
        if any(k.startswith("model.layers.") and ".mlp.experts." in k for k in raw):
            raise CheckpointError("mixture-of-experts MLP layers are not supported (dense MLP checkpoints only)")
        if text.get("attention_bias") or any(k.endswith(".bias") and ".self_attn." in k for k in raw):
            raise CheckpointError("Qwen3.5 attention with biased projections is not supported")
        gdn_keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        try:
            gdn = {k: text[k] for k in gdn_keys}
            attn = _attention_config(text) if FULL_ATTENTION in kinds else {}
        except KeyError as e:
            raise CheckpointError(f"Qwen3.5 config.json lacks {e}") from None
        hk, hv, dk, dv = (positive_int(gdn, k, "Qwen3.5") for k in gdn_keys)  # 0, "x": loading hunt, session 49
        for i, kind in enumerate(kinds):
            mixer = GDN_RAW if kind == LINEAR_ATTENTION else ATTN_RAW
            require(raw, [f"model.layers.{i}.{k}" for k in mixer + MLP_RAW + NORM_RAW], "Qwen3.5")
        p = "model.layers.0."
        check_dims(raw, {p + "mlp.gate_proj.weight": 2}, "Qwen3.5")  # the FFN size is read from it
        ffn = shape_of(raw, p + "mlp.gate_proj.weight")[0]
        conv_kernel = 0
        if LINEAR_ATTENTION in kinds:
            first = kinds.index(LINEAR_ATTENTION)
            conv = raw[f"model.layers.{first}.linear_attn.conv1d.weight"]
            conv_kernel = conv.shape[-1]
        cfg = Qwen35Config(
            n_layer=n_layer, n_embd=embd, vocab_size=vocab, ffn_size=ffn, n_k_heads=hk, n_v_heads=hv, k_head_dim=dk,
            v_head_dim=dv, conv_kernel=conv_kernel, layer_types=kinds, tied_head=HEAD not in raw,
            rms_eps=config_eps(text, "rms_norm_eps", 1e-6, "Qwen3.5"), **attn,
        )  # fmt: skip
        if LINEAR_ATTENTION in kinds:
            first = kinds.index(LINEAR_ATTENTION)
            if (conv.shape[0] != cfg.conv_dim or raw[f"model.layers.{first}.linear_attn.A_log"].numel() != hv
                    or hv % hk):  # fmt: skip
                raise CheckpointError(f"Qwen3.5 tensors do not fit the config's heads ({hk} key x {dk}, {hv} value "
                                      f"x {dv})")  # fmt: skip
        for i in cfg.attention_layers:
            q, k = raw[f"model.layers.{i}.self_attn.q_proj.weight"], raw[f"model.layers.{i}.self_attn.k_proj.weight"]
            if q.shape[0] != 2 * cfg.n_heads * cfg.head_dim or k.shape[0] != cfg.n_kv_heads * cfg.head_dim:
                raise CheckpointError(f"Qwen3.5 attention projections {list(q.shape)}/{list(k.shape)} do not fit "
                                      f"{cfg.n_heads} query (gated) and {cfg.n_kv_heads} key/value heads of "
                                      f"{cfg.head_dim}")  # fmt: skip
        check_shapes(raw, expected_shapes(cfg), "Qwen3.5")
        return cfg


def expected_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every raw tensor's shape for `cfg` (HF's [out, in] matrices): a layer whose tensor differed from the first
    layer's (which the sizes are read from) had failed in torch naming no tensor (loading hunt, session 49)."""
    c, f, hv, q, kv = cfg.n_embd, cfg.ffn_size, cfg.n_v_heads, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, c), HEAD: (cfg.vocab_size, c), FINAL_NORM: (c,)}
    common = {"mlp.gate_proj.weight": (f, c), "mlp.up_proj.weight": (f, c), "mlp.down_proj.weight": (c, f),
              "input_layernorm.weight": (c,), "post_attention_layernorm.weight": (c,)}  # fmt: skip
    gdn = {"linear_attn.in_proj_qkv.weight": (cfg.conv_dim, c), "linear_attn.in_proj_z.weight": (cfg.value_dim, c),
           "linear_attn.in_proj_b.weight": (hv, c), "linear_attn.in_proj_a.weight": (hv, c),
           "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel), "linear_attn.A_log": (hv,),
           "linear_attn.dt_bias": (hv,), "linear_attn.norm.weight": (cfg.v_head_dim,),
           "linear_attn.out_proj.weight": (c, cfg.value_dim)}  # fmt: skip
    attn = {"self_attn.q_proj.weight": (2 * q, c), "self_attn.k_proj.weight": (kv, c),
            "self_attn.v_proj.weight": (kv, c), "self_attn.o_proj.weight": (c, q),
            "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,)}  # fmt: skip
    for i, kind in enumerate(cfg.layer_types):
        mixer = gdn if kind == LINEAR_ATTENTION else attn
        shapes.update({f"model.layers.{i}.{k}": v for k, v in (common | mixer).items()})
    return shapes


def text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's text part: its `text_config` (a multimodal checkpoint's) where it has one, an object."""
    text = hf.get("text_config") or hf
    if not isinstance(text, dict):  # a list had escaped as an AttributeError (loading hunt, session 49)
        raise CheckpointError(f"config.json's text_config is {type(text).__name__}, not an object")
    return text


def derived_layer_types(text: dict[str, Any], n_layer: int) -> list[str]:
    """Layer kinds where config.json gives no layer_types, as transformers derives them: every
    `full_attention_interval`-th layer full attention (they had been taken from the tensors: attention run where
    transformers runs a delta net)."""
    interval = int(text.get("full_attention_interval", 4))
    if interval < 1:
        raise CheckpointError(f"Qwen3.5 config.json's full_attention_interval {interval} is not a layer count")
    return [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layer)]


def _attention_config(text: dict[str, Any]) -> dict[str, Any]:
    """Heads, RoPE and context of the full-attention layers, from config.json (transformers 5's
    `rope_parameters`, or the older top-level `rope_theta` / `partial_rotary_factor`)."""
    heads, kv_heads = int(text["num_attention_heads"]), int(text["num_key_value_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})  # transformers' order
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":  # mrope sections are equal for text-only positions: plain RoPE
        raise CheckpointError(f"Qwen3.5 RoPE type {rope_type!r} is not supported (default only)")
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    if heads % kv_heads or rotary % 2 or not 0 < rotary <= head_dim:
        raise CheckpointError(f"Qwen3.5 attention: {heads} heads over {kv_heads} key/value heads, rotary dims "
                              f"{rotary} of {head_dim}: not a shape wkvm runs")  # fmt: skip
    context = config_context(text, "max_position_embeddings", "Qwen3.5")
    return {"n_heads": heads, "n_kv_heads": kv_heads, "head_dim": head_dim, "rotary_dim": rotary,
            "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            "max_context": context}  # fmt: skip


def state_spec(cfg: Qwen35Config) -> StateSpec:
    tensors: list[TensorSpec] = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL_ATTENTION:
            tensors += kv_tensors(i, cfg.n_kv_heads, cfg.head_dim)
        else:
            tensors += [
                TensorSpec(f"layers.{i}.conv", (cfg.conv_dim, cfg.conv_kernel - 1), kind="conv"),
                TensorSpec(f"layers.{i}.delta", (cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim), kind="recurrent"),
            ]
    return StateSpec(FAMILY, tuple(tensors))


def global_keys(cfg: Qwen35Config) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def raw_layer_keys(cfg: Qwen35Config, i: int) -> tuple[str, ...]:
    mixer = ATTN_RAW if cfg.layer_types[i] == FULL_ATTENTION else GDN_RAW
    return mixer + MLP_RAW + NORM_RAW


def linear_keys(cfg: Qwen35Config, i: int) -> tuple[str, ...]:
    return (ATTN_LINEAR if cfg.layer_types[i] == FULL_ATTENTION else GDN_LINEAR) + MLP_LINEAR


def used_tensors(raw: RawTensors, cfg: Qwen35Config) -> RawTensors:
    keys = set(global_keys(cfg))
    for i in range(cfg.n_layer):
        keys.update(f"model.layers.{i}.{k}" for k in raw_layer_keys(cfg, i))
    return only(raw, keys)


def prepare_layer(
    raw: RawTensors, i: int, cfg: Qwen35Config, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: a GDN layer's four input projections fused into one [out, in] matrix
    (q, k, v | z | b | a) and its conv weight [D, K]; an attention layer's q (with gate), k, v fused; gate and up
    fused; norms as 1 + w; matrices in `dtype`, the rest fp32."""
    p = f"model.layers.{i}."
    keys = raw_layer_keys(cfg, i)
    require(raw, [p + k for k in keys], "Qwen3.5")
    r = {k: raw[p + k].to(device=device, dtype=torch.float32) for k in keys}
    t: Tensors = {
        "input_norm": 1.0 + r["input_layernorm.weight"],
        "post_norm": 1.0 + r["post_attention_layernorm.weight"],
        "mlp.gate_up": torch.cat([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
        "mlp.down_proj.weight": r["mlp.down_proj.weight"],
    }
    if cfg.layer_types[i] == FULL_ATTENTION:
        t.update({
            "self_attn.qkv": torch.cat([r[f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "self_attn.o_proj.weight": r["self_attn.o_proj.weight"],
            "self_attn.q_norm": 1.0 + r["self_attn.q_norm.weight"],
            "self_attn.k_norm": 1.0 + r["self_attn.k_norm.weight"],
        })  # fmt: skip
    else:
        t.update({
            "linear_attn.in_proj": torch.cat([r[f"linear_attn.in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")]),
            "linear_attn.conv": r["linear_attn.conv1d.weight"].reshape(cfg.conv_dim, cfg.conv_kernel),
            "linear_attn.neg_A": -r["linear_attn.A_log"].exp(),
            "linear_attn.dt_bias": r["linear_attn.dt_bias"],
            "linear_attn.norm": r["linear_attn.norm.weight"],
            "linear_attn.out_proj.weight": r["linear_attn.out_proj.weight"],
        })  # fmt: skip
    for k in linear_keys(cfg, i):
        t[k] = stored(t[k], dtype)
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
        self.fused_decode = True  # one kernel call per GDN layer's decode step where it runs (tests turn it off)
        self.kv_layers = cfg.attention_layers
        self.inv_freq = frequencies(cfg.rope_theta, cfg.rotary_dim).to(self.device)

    # norms, gates, SiLU and residuals work row by row: the matmuls, attention and the GDN kernel decide
    row_keys = GDN_LINEAR + ATTN_LINEAR + MLP_LINEAR

    def steps_kernel(self) -> bool:
        return self.fused_decode and kernel_available()

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        eps = self.config.rms_eps
        h = rms_norm(x, w["input_norm"], eps)
        h = (self._attention(i, w, h, attn) if attn is not None and i in self.kv_layers
             else self._gated_delta_net(i, w, h, state))  # fmt: skip
        x, h = add_rms_norm(x, h, w["post_norm"], eps)
        return x + self._mlp(w, h)

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g["final_norm"], self.config.rms_eps), g[HEAD])

    # --- blocks --------------------------------------------------------------------------------
    def _attention(self, i: int, w: Tensors, x: torch.Tensor, attn: Attn) -> torch.Tensor:
        """Gated full attention: q and a per-head gate from one projection, q/k RMSNorm per head, partial RoPE,
        grouped-query attention, output times sigmoid(gate)."""
        cfg = self.config
        B, T, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qg, k, v = torch.split(linear(x, w["self_attn.qkv"]), [2 * H * D, Hkv * D, Hkv * D], -1)
        q, gate = qg.reshape(B, T, H, 2 * D).chunk(2, -1)
        q = rms_norm(q, w["self_attn.q_norm"], cfg.rms_eps)
        k = rms_norm(k.reshape(B, T, Hkv, D), w["self_attn.k_norm"], cfg.rms_eps)
        o = attn.rope_attend(i, q, k, v.reshape(B, T, Hkv, D), D**-0.5) * torch.sigmoid(gate)
        return linear(o.reshape(B, T, H * D), w["self_attn.o_proj.weight"])

    def _gated_delta_net(self, i: int, w: Tensors, x: torch.Tensor, state: State) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        Hk, Hv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
        proj = linear(x, w["linear_attn.in_proj"])
        if self.fused_decode and (T == 1 or self.rows_alone(T)):  # stepping's arithmetic, in one kernel call
            o = layer_steps(proj, state[f"layers.{i}.conv"], w["linear_attn.conv"], state[f"layers.{i}.delta"],
                            w["linear_attn.neg_A"], w["linear_attn.dt_bias"], w["linear_attn.norm"], Hk, dk, L2_EPS,
                            cfg.rms_eps)  # fmt: skip
            if o is not None:
                return linear(o, w["linear_attn.out_proj.weight"])
        qkv, z, b, a = torch.split(proj, [cfg.conv_dim, cfg.value_dim, Hv, Hv], -1)
        qkv = causal_conv_silu(qkv, state[f"layers.{i}.conv"], w["linear_attn.conv"])
        q, k, v = torch.split(qkv, [cfg.key_dim, cfg.key_dim, cfg.value_dim], -1)
        q = q.reshape(B, T, Hk, dk)
        k = k.reshape(B, T, Hk, dk)
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2_EPS) * dk**-0.5
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2_EPS)
        g = w["linear_attn.neg_A"] * F.softplus(a + w["linear_attn.dt_bias"])  # [B, T, Hv]
        beta = torch.sigmoid(b)
        S = state[f"layers.{i}.delta"].view(B * Hv, dk, dv)
        if T == 1:
            if Hv != Hk:
                q, k = q.repeat_interleave(Hv // Hk, 2), k.repeat_interleave(Hv // Hk, 2)
            o = gated_delta_step(S, q.reshape(B * Hv, dk), k.reshape(B * Hv, dk), v.reshape(B * Hv, dv),
                                 g.reshape(B * Hv), beta.reshape(B * Hv))  # fmt: skip
        else:
            o = gated_delta_chunked(S, q, k, v.reshape(B, T, Hv, dv), g, beta, chunk=self.delta_chunk)
        o = rms_norm(o.reshape(B, T, Hv, dv), w["linear_attn.norm"], cfg.rms_eps)
        o = o * F.silu(z.reshape(B, T, Hv, dv))
        return linear(o.reshape(B, T, cfg.value_dim), w["linear_attn.out_proj.weight"])

    @staticmethod
    def _mlp(w: Tensors, x: torch.Tensor) -> torch.Tensor:
        return linear(silu_mul(linear(x, w["mlp.gate_up"])), w["mlp.down_proj.weight"])
