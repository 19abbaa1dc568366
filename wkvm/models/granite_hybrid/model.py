"""Granite 4.0 H (IBM's Mamba2 + attention hybrid, HF `GraniteMoeHybridForCausalLM` without experts): the forward
pass, state explicit.

Bamba's layout (its Mamba2 mixers under `mamba.`, the Mamba2 family's own code) with Granite's scalings: the
embedding times `embedding_multiplier`, each sublayer's output times `residual_multiplier` before its residual add,
attention scaled by `attention_multiplier` (not head_dim^-0.5), the logits divided by `logits_scaling`. The MLP is
`shared_mlp` (`input_linear` gives gate then up, SiLU; `output_linear`). Attention has RoPE over the whole head where
`position_embedding_type` is "rope", else none (NoPE: llama.cpp runs every Granite 4.0 H so). State: as Bamba's
(per Mamba2 layer its conv window and SSM state; per attention layer keys and values). Raw tensor names are HF's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from wkvm.models.bamba.model import (
    ATTENTION,
    ATTN_RAW,
    HEAD,
    MAMBA,
    MIXER_RAW,
    PREFIX,
    Bamba,
    BambaConfig,
    linear_keys,
    mamba_config,
)
from wkvm.models.family import (
    CheckpointError,
    RawTensors,
    check_bias_flags,
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
from wkvm.models.kv import Attn
from wkvm.models.linear import embedding, linear, stored
from wkvm.models.mamba2.model import mixer, mixer_shapes, mixer_tensors
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.spec import State

FAMILY = "granite_hybrid"
KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
EMBED, FINAL_NORM = "model.embed_tokens.weight", "model.norm.weight"
MLP_RAW = ("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight")
NORM_RAW = ("input_layernorm.weight", "post_attention_layernorm.weight")
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@dataclass(frozen=True)
class GraniteHybridConfig(BambaConfig):
    """Bamba's shape (`rotary_dim` the whole head) with Granite's positions and scalings."""

    rope: bool = False  # RoPE over the whole head (position_embedding_type "rope"), else no positions (NoPE)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @staticmethod
    def from_checkpoint(raw: RawTensors, hf: dict[str, Any]) -> GraniteHybridConfig:
        """Sizes from the tensors; heads, multipliers, positions, groups and eps from config.json."""
        what = "Granite 4.0 H"
        require(raw, [EMBED, FINAL_NORM], what)
        vocab, embd = matrix_shape(raw, EMBED, what)
        n_layer = layer_count(raw, PREFIX)
        check_layer_count(hf, n_layer, what)
        kinds = tuple(ATTENTION if f"{PREFIX}{i}.self_attn.q_proj.weight" in raw else MAMBA for i in range(n_layer))
        declared = hf.get("layer_types") or hf.get("layers_block_type") or [MAMBA] * n_layer
        if tuple(KINDS.get(k, k) for k in declared) != kinds:
            raise CheckpointError(f"{what} config.json's layer kinds {list(declared)} do not match the tensors "
                                  f"({list(kinds)})")  # fmt: skip
        experts = hf.get("num_local_experts", 8)  # transformers' default builds 8 experts
        if experts or any(".block_sparse_moe." in k for k in raw):
            raise CheckpointError(f"{what} with experts (num_local_experts {experts!r}: Granite 4.0 H Tiny / Small) "
                                  "is not supported; the dense models (H 350M, 1B, Micro) are")  # fmt: skip
        if hf.get("attention_bias") or hf.get("mamba_proj_bias"):
            raise CheckpointError(f"{what} with biased projections is not supported")
        if MAMBA in kinds:
            check_bias_flags(hf, raw, {"mamba_conv_bias": f"{PREFIX}{kinds.index(MAMBA)}.mamba.conv1d.bias"}, what)
        check_silu(hf, what)
        for i, kind in enumerate(kinds):
            require(raw, [f"{PREFIX}{i}.{k}" for k in (MIXER_RAW if kind == MAMBA else ATTN_RAW) + MLP_RAW + NORM_RAW],
                    what)  # fmt: skip
        heads = positive_int(hf, "num_attention_heads", what)
        kv_heads = positive_int(hf, "num_key_value_heads", what, default=heads)
        head_dim = positive_int(hf, "head_dim", what, default=embd // heads)
        if heads % kv_heads or head_dim % 2:
            raise CheckpointError(f"{what} attention: {heads} heads over {kv_heads} key/value heads of {head_dim}: "
                                  "not a shape wkvm runs")  # fmt: skip
        positions = hf.get("position_embedding_type")
        if positions not in (None, "nope", "rope"):
            raise CheckpointError(f"{what} position_embedding_type {positions!r} is not supported (rope or none)")
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})  # transformers' order
        if positions == "rope" and (rope.get("rope_type") or rope.get("type") or "default") != "default":
            raise CheckpointError(f"{what} RoPE type {rope.get('rope_type') or rope.get('type')!r} is not supported "
                                  "(default only)")  # fmt: skip
        scales = {}
        for key in MULTIPLIERS:
            value = hf.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
                    key == "logits_scaling" and value == 0):  # fmt: skip
                raise CheckpointError(f"{what} config.json's {key} {value!r:.60} is not a finite number"
                                      + (" other than 0" if key == "logits_scaling" else ""))  # fmt: skip
            scales[key] = float(value)
        n_groups = positive_int(hf, "mamba_n_groups", what, default=1)
        mamba = mamba_config(raw, kinds, n_layer, vocab, embd, n_groups, hf, what)
        ffn = shape_of_ffn(raw, what)
        cfg = GraniteHybridConfig(
            n_layer=n_layer, n_embd=embd, vocab_size=vocab, ffn_size=ffn, layer_types=kinds, mamba=mamba,
            n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=head_dim, rope=positions == "rope",
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), **scales,
            tied_head=HEAD not in raw, rms_eps=config_eps(hf, "rms_norm_eps", 1e-6, what),
            max_context=config_context(hf, "max_position_embeddings", what),
        )  # fmt: skip
        check_shapes(raw, expected_shapes(cfg), what)
        return cfg


def shape_of_ffn(raw: RawTensors, what: str) -> int:
    """The shared MLP's hidden size, read from layer 0's output_linear [C, F]."""
    name = f"{PREFIX}0.shared_mlp.output_linear.weight"
    return matrix_shape(raw, name, what)[1]


def expected_shapes(cfg: GraniteHybridConfig) -> dict[str, tuple[int, ...]]:
    """Every raw tensor's shape for `cfg` (HF's [out, in] matrices; the Mamba2 mixers' as the Mamba2 family's)."""
    c, q, kv, f = cfg.n_embd, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, c), HEAD: (cfg.vocab_size, c), FINAL_NORM: (c,)}
    attn = {"self_attn.q_proj.weight": (q, c), "self_attn.k_proj.weight": (kv, c), "self_attn.v_proj.weight": (kv, c),
            "self_attn.o_proj.weight": (c, q)}
    rest = {"shared_mlp.input_linear.weight": (2 * f, c), "shared_mlp.output_linear.weight": (c, f),
            "input_layernorm.weight": (c,), "post_attention_layernorm.weight": (c,)}  # fmt: skip
    for i, kind in enumerate(cfg.layer_types):
        p = f"{PREFIX}{i}."
        shapes.update({p + k: v for k, v in rest.items()})
        if kind == ATTENTION:
            shapes.update({p + k: v for k, v in attn.items()})
        else:
            shapes.update(mixer_shapes(cfg.mamba, p + "mamba."))
    return shapes


def global_keys(cfg: GraniteHybridConfig) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def used_tensors(raw: RawTensors) -> RawTensors:
    keep = {EMBED, FINAL_NORM, HEAD}
    for i in range(layer_count(raw, PREFIX)):
        keep.update(f"{PREFIX}{i}.{k}" for k in MIXER_RAW + ("mamba.conv1d.bias",) + ATTN_RAW + MLP_RAW + NORM_RAW)
    return only(raw, keep)


def prepare_layer(
    raw: RawTensors, i: int, cfg: GraniteHybridConfig, dtype: torch.dtype, device: torch.device | str,
    pack: bool = True,
) -> Tensors:  # fmt: skip
    """Layer i in compute form: a Mamba2 layer's mixer as the Mamba2 family prepares it, or an attention layer's
    q, k, v fused; the shared MLP's input_linear (already gate then up); matrices in `dtype`, norms fp32."""
    p = f"{PREFIX}{i}."
    require(raw, [p + k for k in MLP_RAW + NORM_RAW], "Granite 4.0 H")
    t: Tensors = {
        "input_norm": raw[p + "input_layernorm.weight"].to(device=device, dtype=torch.float32),
        "post_norm": raw[p + "post_attention_layernorm.weight"].to(device=device, dtype=torch.float32),
        "mlp.gate_up": stored(raw[p + "shared_mlp.input_linear.weight"].to(device), dtype),
        "mlp.down_proj.weight": stored(raw[p + "shared_mlp.output_linear.weight"].to(device), dtype),
    }
    if cfg.layer_types[i] == ATTENTION:
        require(raw, [p + k for k in ATTN_RAW], "Granite 4.0 H")
        t["self_attn.qkv"] = stored(torch.cat([raw[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]).to(device), dtype)
        t["self_attn.o_proj.weight"] = stored(raw[p + "self_attn.o_proj.weight"].to(device), dtype)
    else:
        t.update(mixer_tensors(raw, p + "mamba.", cfg.mamba, dtype, device))
    return compute_form(t, linear_keys(cfg, i), pack)


def prepare_globals(raw: RawTensors, cfg: GraniteHybridConfig, dtype: torch.dtype,
                    device: torch.device | str) -> Tensors:  # fmt: skip
    require(raw, global_keys(cfg), "Granite 4.0 H")
    embed, head = embedding_and_head(raw, EMBED, HEAD, cfg.tied_head, dtype, device)
    return resident({EMBED: embed, "final_norm": raw[FINAL_NORM].to(device=device, dtype=torch.float32), HEAD: head})


class GraniteHybrid(Bamba):
    """Bamba's model (its Mamba2 mixer kernel, attention over `KVBatch`) with Granite's scalings and positions."""

    family = FAMILY
    config: GraniteHybridConfig

    def __init__(self, cfg: GraniteHybridConfig, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, weights, model_fingerprint, device)
        if not cfg.rope:  # NoPE as RoPE at angle 0: cos 1 and sin 0 give every key and query its own bits
            self.inv_freq = torch.zeros_like(self.inv_freq)
        self.attention_scale = cfg.attention_multiplier

    def embed(self, tokens: torch.Tensor, g: Tensors) -> torch.Tensor:
        return embedding(tokens, g[EMBED]) * self.config.embedding_multiplier

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g["final_norm"], self.config.rms_eps), g[HEAD]) / self.config.logits_scaling

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        cfg = self.config
        h = rms_norm(x, w["input_norm"], cfg.rms_eps)
        if attn is not None and i in self.kv_layers:
            h = self._attention(i, w, h, attn)
        else:
            T = h.shape[1]
            h = mixer(cfg.mamba, w, h, state[f"layers.{i}.conv"], state[f"layers.{i}.ssm"], self.ssd_chunk,
                      self.fused_decode, T > 1 and self.rows_alone(T))  # fmt: skip
        x, h = add_rms_norm(x, h * cfg.residual_multiplier, w["post_norm"], cfg.rms_eps)
        return x + linear(silu_mul(linear(h, w["mlp.gate_up"])), w["mlp.down_proj.weight"]) * cfg.residual_multiplier
