"""Bamba (IBM's Mamba2 + attention hybrid, HF `BambaForCausalLM`): the forward pass, state explicit.

A decoder layer is a token mixer then a dense SwiGLU MLP (`feed_forward`), each behind a pre-RMSNorm. The mixer is
a Mamba2 mixer (`linear_attention`, the Mamba2 family's own code) or grouped-query attention with RoPE on the first
half of each head (`full_attention`, no q/k norm). State per Mamba2 layer i: `layers.{i}.conv` [conv_dim, K-1] and
`layers.{i}.ssm` [H, P, N], as in the Mamba2 family; per attention layer i: `layers.{i}.k` / `layers.{i}.v`, one
[Hkv, D] entry per token (kind "kv", keys after RoPE). Raw tensor names are the HF Bamba names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wkvm.models.family import (
    CheckpointError,
    ModelBase,
    RawTensors,
    check_bias_flags,
    check_dims,
    check_layer_count,
    check_shapes,
    check_silu,
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
from wkvm.models.mamba2.model import (
    Mamba2Config,
    check_state_size,
    mixer,
    mixer_shapes,
    mixer_state,
    mixer_tensors,
    time_step_limit,
)
from wkvm.models.mamba2.ssd import DEFAULT_CHUNK, kernel_available
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.rope import frequencies
from wkvm.models.spec import State, StateSpec, TensorSpec

FAMILY = "bamba"
MAMBA, ATTENTION = "linear_attention", "full_attention"
PREFIX = "model.layers."
EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.final_layernorm.weight", "lm_head.weight"
MIXER_RAW = ("mamba.in_proj.weight", "mamba.conv1d.weight", "mamba.dt_bias", "mamba.A_log", "mamba.D",
             "mamba.norm.weight", "mamba.out_proj.weight")  # fmt: skip
ATTN_RAW = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
MLP_RAW = ("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight", "feed_forward.down_proj.weight")
NORM_RAW = ("input_layernorm.weight", "pre_ff_layernorm.weight")
MAMBA_LINEAR = ("mixer.in_proj.weight", "mixer.out_proj.weight")
ATTN_LINEAR = ("self_attn.qkv", "self_attn.o_proj.weight")
MLP_LINEAR = ("mlp.gate_up", "mlp.down_proj.weight")


@dataclass(frozen=True)
class BambaConfig:
    n_layer: int
    n_embd: int
    vocab_size: int
    ffn_size: int
    layer_types: tuple[str, ...]
    mamba: Mamba2Config  # the Mamba2 layers' shape (its n_layer and vocab are the whole model's)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 10000.0
    tied_head: bool = False
    rms_eps: float = 1e-5
    max_context: int | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == ATTENTION)

    @staticmethod
    def from_checkpoint(raw: RawTensors, hf: dict[str, Any]) -> BambaConfig:
        """Sizes from the tensors where they show; heads, groups, RoPE and eps from config.json."""
        require(raw, [EMBED, FINAL_NORM], "Bamba")
        vocab, embd = matrix_shape(raw, EMBED, "Bamba")
        n_layer = layer_count(raw, PREFIX)
        check_layer_count(hf, n_layer, "Bamba")
        kinds = tuple(ATTENTION if f"{PREFIX}{i}.self_attn.q_proj.weight" in raw else MAMBA for i in range(n_layer))
        if MAMBA in kinds:
            check_bias_flags(hf, raw, {"mamba_conv_bias": f"{PREFIX}{kinds.index(MAMBA)}.mamba.conv1d.bias"}, "Bamba")
        declared = tuple(hf.get("layers_block_type") or hf.get("layer_types") or
                         [ATTENTION if i in (hf.get("attn_layer_indices") or []) else MAMBA for i in range(n_layer)])
        if declared != kinds:
            raise CheckpointError(f"Bamba config.json's layer kinds {list(declared)} do not match the tensors "
                                  f"({list(kinds)})")  # fmt: skip
        if hf.get("attention_bias") or hf.get("mlp_bias") or hf.get("mamba_proj_bias"):
            raise CheckpointError("Bamba with biased projections is not supported")
        check_silu(hf, "Bamba")
        for i, kind in enumerate(kinds):
            mixer_raw = MIXER_RAW if kind == MAMBA else ATTN_RAW
            require(raw, [f"{PREFIX}{i}.{k}" for k in mixer_raw + MLP_RAW + NORM_RAW], "Bamba")
        try:
            heads = int(hf["num_attention_heads"])
            kv_heads = int(hf.get("num_key_value_heads") or heads)
            hf["mamba_n_groups"]
        except KeyError as e:
            raise CheckpointError(f"Bamba config.json lacks {e}") from None
        n_groups = positive_int(hf, "mamba_n_groups", "Bamba")  # 1.5 and true had been taken (loading hunt, 49)
        head_dim = int(hf.get("head_dim") or embd // heads)
        # transformers' reading: `rope_scaling` before `rope_parameters`, its type under `rope_type` or `type`, the
        # partial factor from there only (Bamba's own 0.5 otherwise); a legacy linear scaling had run as plain RoPE
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type != "default":
            raise CheckpointError(f"Bamba RoPE type {rope_type!r} is not supported (default only)")
        rotary = int(head_dim * float(rope.get("partial_rotary_factor", 0.5)))
        mamba = mamba_config(raw, kinds, n_layer, vocab, embd, n_groups, hf)
        check_dims(raw, {f"{PREFIX}0.feed_forward.gate_proj.weight": 2}, "Bamba")  # the FFN size is read from it
        ffn = raw[f"{PREFIX}0.feed_forward.gate_proj.weight"].shape[0]
        cfg = BambaConfig(
            n_layer=n_layer, n_embd=embd, vocab_size=vocab, ffn_size=ffn,
            layer_types=kinds, mamba=mamba, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), tied_head=HEAD not in raw,
            rms_eps=config_eps(hf, "rms_norm_eps", 1e-5, "Bamba"),
            max_context=config_context(hf, "max_position_embeddings", "Bamba"),
        )  # fmt: skip
        if heads % kv_heads or rotary % 2 or not 0 < rotary <= head_dim:
            raise CheckpointError(f"Bamba attention: {heads} heads over {kv_heads} key/value heads, rotary dims "
                                  f"{rotary} of {head_dim}: not a shape wkvm runs")  # fmt: skip
        check_shapes(raw, expected_shapes(cfg), "Bamba")
        return cfg


def expected_shapes(cfg: BambaConfig) -> dict[str, tuple[int, ...]]:
    """Every raw tensor's shape for `cfg` (HF's [out, in] matrices; the Mamba2 mixers' as the Mamba2 family's)."""
    c, q, kv, f = cfg.n_embd, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, c), HEAD: (cfg.vocab_size, c), FINAL_NORM: (c,)}
    attn = {"self_attn.q_proj.weight": (q, c), "self_attn.k_proj.weight": (kv, c), "self_attn.v_proj.weight": (kv, c),
            "self_attn.o_proj.weight": (c, q)}
    rest = {"feed_forward.gate_proj.weight": (f, c), "feed_forward.up_proj.weight": (f, c),
            "feed_forward.down_proj.weight": (c, f), "input_layernorm.weight": (c,), "pre_ff_layernorm.weight": (c,)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"{PREFIX}{i}."
        shapes.update({p + k: v for k, v in rest.items()})
        if kind == ATTENTION:
            shapes.update({p + k: v for k, v in attn.items()})
        else:
            shapes.update(mixer_shapes(cfg.mamba, p + "mamba."))
    return shapes


def mamba_config(raw: RawTensors, kinds: tuple[str, ...], n_layer: int, vocab: int, embd: int, n_groups: int,
                 hf: dict[str, Any], what: str = "Bamba", mixer: str = "mamba.",
                 keys: tuple[str, str, str] = ("mamba_d_state", "mamba_n_groups", "rms_norm_eps"),
                 ) -> Mamba2Config:  # fmt: skip
    """The Mamba2 layers' shape, read from the first one's tensors (under `mixer.` in its layer: Bamba's layout, which
    Granite 4.0 H shares; Nemotron-H's `mixer.`), its config.json keys for the state size, groups and eps `keys`."""
    if MAMBA not in kinds:
        raise CheckpointError(f"a {what} checkpoint without Mamba2 layers: serve it as Llama")
    p = f"{PREFIX}{kinds.index(MAMBA)}.{mixer}"
    check_dims(raw, {p + "A_log": 1, p + "out_proj.weight": 2, p + "conv1d.weight": 3}, what)
    n_heads = raw[p + "A_log"].shape[0]
    d_inner = raw[p + "out_proj.weight"].shape[1]
    conv_dim, _, d_conv = raw[p + "conv1d.weight"].shape
    d_state = (conv_dim - d_inner) // (2 * n_groups)
    if d_inner % n_heads or conv_dim != d_inner + 2 * n_groups * d_state:
        raise CheckpointError(f"{what} Mamba2 layers: conv1d has {conv_dim} channels; expected {d_inner} + 2 x "
                              f"{n_groups} groups x d_state")  # fmt: skip
    check_state_size(hf, keys[0], keys[1], d_state, conv_dim, d_inner, f"{what} Mamba2 layers")
    dt_min, dt_max = time_step_limit(hf)
    return Mamba2Config(
        n_layer=n_layer, d_model=embd, d_inner=d_inner, n_heads=n_heads, head_dim=d_inner // n_heads,
        d_state=d_state, n_groups=n_groups, d_conv=d_conv, vocab_size=vocab, tie_embeddings=HEAD not in raw,
        norm_eps=config_eps(hf, keys[2], 1e-5, what), dt_min=dt_min,
        dt_max=None if dt_max == float("inf") else dt_max,
    )  # fmt: skip


def state_spec(cfg: BambaConfig, family: str = FAMILY) -> StateSpec:
    """The state of `cfg`'s layers, under `family`'s name (Granite 4.0 H's and Nemotron-H's have Bamba's tensors):
    keys and values for attention layers, the conv window and SSM state for Mamba2 layers; layers of another kind
    (Nemotron-H's MLP layers) keep none."""
    tensors: list[TensorSpec] = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == ATTENTION:
            tensors += kv_tensors(i, cfg.n_kv_heads, cfg.head_dim)
        elif kind == MAMBA:
            tensors += mixer_state(cfg.mamba, i)
    return StateSpec(family, tuple(tensors))


def global_keys(cfg: BambaConfig) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def linear_keys(cfg: BambaConfig, i: int) -> tuple[str, ...]:
    return (ATTN_LINEAR if cfg.layer_types[i] == ATTENTION else MAMBA_LINEAR) + MLP_LINEAR


def used_tensors(raw: RawTensors) -> RawTensors:
    keep = {EMBED, FINAL_NORM, HEAD}
    for i in range(layer_count(raw, PREFIX)):
        keep.update(f"{PREFIX}{i}.{k}" for k in MIXER_RAW + ("mamba.conv1d.bias",) + ATTN_RAW + MLP_RAW + NORM_RAW)
    return only(raw, keep)


def prepare_layer(
    raw: RawTensors, i: int, cfg: BambaConfig, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: a Mamba2 layer's mixer as the Mamba2 family prepares it, or an attention layer's
    q, k, v fused; gate and up fused; matrices in `dtype`, norms fp32."""
    p = f"{PREFIX}{i}."
    require(raw, [p + k for k in MLP_RAW + NORM_RAW], "Bamba")
    f32 = {k: raw[p + k].to(device=device, dtype=torch.float32) for k in MLP_RAW + NORM_RAW}
    t: Tensors = {
        "input_norm": f32["input_layernorm.weight"],
        "post_norm": f32["pre_ff_layernorm.weight"],
        "mlp.gate_up": stored(torch.cat([f32[f"feed_forward.{x}_proj.weight"] for x in ("gate", "up")]), dtype),
        "mlp.down_proj.weight": stored(f32["feed_forward.down_proj.weight"], dtype),
    }
    if cfg.layer_types[i] == ATTENTION:
        require(raw, [p + k for k in ATTN_RAW], "Bamba")
        t["self_attn.qkv"] = stored(torch.cat([raw[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]).to(device), dtype)
        t["self_attn.o_proj.weight"] = stored(raw[p + "self_attn.o_proj.weight"].to(device), dtype)
    else:
        t.update(mixer_tensors(raw, p + "mamba.", cfg.mamba, dtype, device))
    return compute_form(t, linear_keys(cfg, i), pack)


def prepare_globals(raw: RawTensors, cfg: BambaConfig, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    require(raw, global_keys(cfg), "Bamba")
    embed, head = embedding_and_head(raw, EMBED, HEAD, cfg.tied_head, dtype, device)
    return resident({EMBED: embed, "final_norm": raw[FINAL_NORM].to(device=device, dtype=torch.float32), HEAD: head})


class Bamba(ModelBase):
    family = FAMILY
    embed_key = EMBED
    config: BambaConfig

    def __init__(self, cfg: BambaConfig, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, state_spec(cfg, self.family), weights, model_fingerprint, device)
        self.ssd_chunk = DEFAULT_CHUNK
        self.fused_decode = True  # the mixer kernel (one-token steps, chunks with stepping's bits); tests turn it off
        self.kv_layers = cfg.attention_layers
        self.inv_freq = frequencies(cfg.rope_theta, cfg.rotary_dim).to(self.device)
        self.attention_scale = cfg.head_dim**-0.5

    # norms, gates, SiLU and residuals work row by row: the matmuls, attention and the mixer's kernel decide
    row_keys = MAMBA_LINEAR + ATTN_LINEAR + MLP_LINEAR

    def steps_kernel(self) -> bool:
        return self.fused_decode and kernel_available()

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g["final_norm"], self.config.rms_eps), g[HEAD])

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        eps = self.config.rms_eps
        h = rms_norm(x, w["input_norm"], eps)
        if attn is not None and i in self.kv_layers:
            h = self._attention(i, w, h, attn)
        else:
            T = h.shape[1]
            h = mixer(self.config.mamba, w, h, state[f"layers.{i}.conv"], state[f"layers.{i}.ssm"], self.ssd_chunk,
                      self.fused_decode, T > 1 and self.rows_alone(T))  # fmt: skip
        x, h = add_rms_norm(x, h, w["post_norm"], eps)
        return x + linear(silu_mul(linear(h, w["mlp.gate_up"])), w["mlp.down_proj.weight"])

    def _attention(self, i: int, w: Tensors, x: torch.Tensor, attn: Attn) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = torch.split(linear(x, w["self_attn.qkv"]), [H * D, Hkv * D, Hkv * D], -1)
        o = attn.rope_attend(i, q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D),
                             self.attention_scale)  # fmt: skip
        return linear(o.reshape(B, T, H * D), w["self_attn.o_proj.weight"])
