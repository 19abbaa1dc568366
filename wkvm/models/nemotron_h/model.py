"""Nemotron-H (NVIDIA's hybrid, HF `NemotronHForCausalLM` without experts): the forward pass, state explicit.

Every layer is one RMSNorm (`norm`), one mixer and a residual add; the mixer is a Mamba2 mixer (`linear_attention`,
"M" in `hybrid_override_pattern`: the Mamba2 family's own code and kernels), grouped-query attention without
positions (`full_attention`, "*": scale head_dim^-0.5, no RoPE), or an MLP (`mlp`, "-": up_proj, ReLU squared,
down_proj; no gate). The model ends in `norm_f` and the head. State per Mamba2 layer i: `layers.{i}.conv`
[conv_dim, K-1] and `layers.{i}.ssm` [H, P, N]; per attention layer i: `layers.{i}.k` / `layers.{i}.v`, one
[Hkv, D] entry per token (kind "kv"); MLP layers have none. Raw tensor names are transformers 5's (`model.`; the
released checkpoints' `backbone.` is renamed when read, as transformers does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wkvm.models.bamba.model import (
    ATTENTION,
    ATTN_LINEAR,
    MAMBA,
    MAMBA_LINEAR,
    PREFIX,
    Bamba,
    BambaConfig,
    mamba_config,
)
from wkvm.models.family import (
    CheckpointError,
    RawTensors,
    check_bias_flags,
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
from wkvm.models.fused import rms_norm
from wkvm.models.kv import Attn
from wkvm.models.linear import linear, stored
from wkvm.models.mamba2.model import mixer, mixer_shapes, mixer_tensors
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.spec import State

FAMILY = "nemotron_h"
MLP = "mlp"
KINDS = {"M": MAMBA, "mamba": MAMBA, MAMBA: MAMBA, "*": ATTENTION, "attention": ATTENTION, ATTENTION: ATTENTION,
         "-": MLP, MLP: MLP, "E": "moe", "moe": "moe"}  # fmt: skip
EMBED, FINAL_NORM, HEAD = "model.embeddings.weight", "model.norm_f.weight", "lm_head.weight"
MIXER_RAW = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.dt_bias", "mixer.A_log", "mixer.D",
             "mixer.norm.weight", "mixer.out_proj.weight")  # fmt: skip
ATTN_RAW = ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight", "mixer.o_proj.weight")
MLP_RAW = ("mixer.up_proj.weight", "mixer.down_proj.weight")
MLP_LINEAR = ("mlp.up_proj.weight", "mlp.down_proj.weight")
WHAT = "Nemotron-H"


@dataclass(frozen=True)
class NemotronHConfig(BambaConfig):
    """Bamba's shape (`rotary_dim` the whole head, unused: no positions; `ffn_size` the MLP layers'), its layer kinds
    Mamba2, attention and MLP."""

    @staticmethod
    def from_checkpoint(raw: RawTensors, hf: dict[str, Any]) -> NemotronHConfig:
        """Layer kinds from config.json (checked against the tensors), sizes from the tensors, heads and eps from
        config.json."""
        require(raw, [EMBED, FINAL_NORM], WHAT)
        vocab, embd = matrix_shape(raw, EMBED, WHAT)
        n_layer = layer_count(raw, PREFIX)
        declared = hf.get("layers_block_type") or hf.get("layer_types") or hf.get("hybrid_override_pattern")
        if not isinstance(declared, list | str) or len(declared) != n_layer:
            raise CheckpointError(f"{WHAT} config.json's layer kinds {declared!r:.200} do not name the weights' "
                                  f"{n_layer} layers (layers_block_type, or hybrid_override_pattern)")  # fmt: skip
        kinds = tuple(KINDS.get(k, k) for k in declared)
        if "moe" in kinds:
            raise CheckpointError(f"{WHAT} with experts (mixture-of-experts layers, Nemotron 3 Nano) is not supported")
        held = tuple(ATTENTION if f"{PREFIX}{i}.mixer.q_proj.weight" in raw else
                     MLP if f"{PREFIX}{i}.mixer.up_proj.weight" in raw else MAMBA for i in range(n_layer))  # fmt: skip
        if kinds != held:
            raise CheckpointError(f"{WHAT} config.json's layer kinds {list(declared)} do not match the tensors "
                                  f"({list(held)})")  # fmt: skip
        check_layer_count(hf, n_layer, WHAT)
        if hf.get("attention_bias") or hf.get("mlp_bias") or hf.get("use_bias"):
            raise CheckpointError(f"{WHAT} with biased projections is not supported")
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if hf.get(key, want) != want:
                raise CheckpointError(f"{WHAT} config.json sets {key} {hf[key]!r}: only {want} is supported")
        if hf.get("sliding_window"):
            raise CheckpointError(f"{WHAT} with sliding-window attention is not supported")
        if MAMBA in kinds:
            check_bias_flags(hf, raw, {"use_conv_bias": f"{PREFIX}{kinds.index(MAMBA)}.mixer.conv1d.bias"}, WHAT)
        for i, kind in enumerate(kinds):
            names = {MAMBA: MIXER_RAW, ATTENTION: ATTN_RAW, MLP: MLP_RAW}[kind]
            require(raw, [f"{PREFIX}{i}.{k}" for k in (*names, "norm.weight")], WHAT)
        heads = positive_int(hf, "num_attention_heads", WHAT)
        kv_heads = positive_int(hf, "num_key_value_heads", WHAT, default=8)  # transformers' NemotronHConfig default
        # transformers' NemotronHConfig defaults head_dim to 128, not the width over the heads: where config.json
        # gives none, the first attention layer's q rows say it
        q_rows = raw[f"{PREFIX}{kinds.index(ATTENTION)}.mixer.q_proj.weight"].shape[0] if ATTENTION in kinds else 0
        head_dim = positive_int(hf, "head_dim", WHAT, default=q_rows // heads or 128)
        if heads % kv_heads or head_dim % 2:
            raise CheckpointError(f"{WHAT} attention: {heads} heads over {kv_heads} key/value heads of {head_dim}: "
                                  "not a shape wkvm runs")  # fmt: skip
        n_groups = positive_int(hf, "n_groups", WHAT, default=8)
        mamba = mamba_config(raw, kinds, n_layer, vocab, embd, n_groups, hf, WHAT, "mixer.",
                             ("ssm_state_size", "n_groups", "layer_norm_epsilon"))  # fmt: skip
        ffn = matrix_shape(raw, f"{PREFIX}{kinds.index(MLP)}.mixer.up_proj.weight", WHAT)[0] if MLP in kinds else 0
        cfg = NemotronHConfig(
            n_layer=n_layer, n_embd=embd, vocab_size=vocab, ffn_size=ffn, layer_types=kinds, mamba=mamba,
            n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=head_dim, tied_head=HEAD not in raw,
            rms_eps=config_eps(hf, "layer_norm_epsilon", 1e-5, WHAT),
            max_context=config_context(hf, "max_position_embeddings", WHAT),
        )  # fmt: skip
        check_shapes(raw, expected_shapes(cfg), WHAT)
        return cfg


def expected_shapes(cfg: NemotronHConfig) -> dict[str, tuple[int, ...]]:
    """Every raw tensor's shape for `cfg` (HF's [out, in] matrices; the Mamba2 mixers' as the Mamba2 family's)."""
    c, q, kv, f = cfg.n_embd, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, c), HEAD: (cfg.vocab_size, c), FINAL_NORM: (c,)}
    attn = {"mixer.q_proj.weight": (q, c), "mixer.k_proj.weight": (kv, c), "mixer.v_proj.weight": (kv, c),
            "mixer.o_proj.weight": (c, q)}
    mlp = {"mixer.up_proj.weight": (f, c), "mixer.down_proj.weight": (c, f)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"{PREFIX}{i}."
        shapes[p + "norm.weight"] = (c,)
        if kind == MAMBA:
            shapes.update(mixer_shapes(cfg.mamba, p + "mixer."))
        else:
            shapes.update({p + k: v for k, v in (attn if kind == ATTENTION else mlp).items()})
    return shapes


def global_keys(cfg: NemotronHConfig) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def linear_keys(cfg: NemotronHConfig, i: int) -> tuple[str, ...]:
    return {MAMBA: MAMBA_LINEAR, ATTENTION: ATTN_LINEAR, MLP: MLP_LINEAR}[cfg.layer_types[i]]


def used_tensors(raw: RawTensors) -> RawTensors:
    keep = {EMBED, FINAL_NORM, HEAD}
    for i in range(layer_count(raw, PREFIX)):
        keep.update(f"{PREFIX}{i}.{k}" for k in (*MIXER_RAW, "mixer.conv1d.bias", *ATTN_RAW, *MLP_RAW, "norm.weight"))
    return only(raw, keep)


def prepare_layer(
    raw: RawTensors, i: int, cfg: NemotronHConfig, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: a Mamba2 layer's mixer as the Mamba2 family prepares it, an attention layer's q, k, v
    fused, or an MLP's two matrices; matrices in `dtype`, the norm fp32."""
    p = f"{PREFIX}{i}."
    require(raw, [p + "norm.weight"], WHAT)
    t: Tensors = {"norm": raw[p + "norm.weight"].to(device=device, dtype=torch.float32)}
    kind = cfg.layer_types[i]
    if kind == ATTENTION:
        require(raw, [p + k for k in ATTN_RAW], WHAT)
        t["self_attn.qkv"] = stored(torch.cat([raw[f"{p}mixer.{x}_proj.weight"] for x in "qkv"]).to(device), dtype)
        t["self_attn.o_proj.weight"] = stored(raw[p + "mixer.o_proj.weight"].to(device), dtype)
    elif kind == MLP:
        require(raw, [p + k for k in MLP_RAW], WHAT)
        t.update({f"mlp.{x}_proj.weight": stored(raw[f"{p}mixer.{x}_proj.weight"].to(device), dtype)
                  for x in ("up", "down")})  # fmt: skip
    else:
        t.update(mixer_tensors(raw, p + "mixer.", cfg.mamba, dtype, device))
    return compute_form(t, linear_keys(cfg, i), pack)


def prepare_globals(raw: RawTensors, cfg: NemotronHConfig, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    require(raw, global_keys(cfg), WHAT)
    embed, head = embedding_and_head(raw, EMBED, HEAD, cfg.tied_head, dtype, device)
    return resident({EMBED: embed, "final_norm": raw[FINAL_NORM].to(device=device, dtype=torch.float32), HEAD: head})


class NemotronH(Bamba):
    """Bamba's model (its Mamba2 mixer kernel, attention over `KVBatch` at head_dim^-0.5) with one mixer a layer,
    MLP layers among them, and no positions."""

    family = FAMILY
    embed_key = EMBED
    config: NemotronHConfig

    def __init__(self, cfg: NemotronHConfig, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, weights, model_fingerprint, device)
        # no positions, as RoPE at angle 0: cos 1 and sin 0 give every key and query its own bits
        self.inv_freq = torch.zeros_like(self.inv_freq)

    # the norm, ReLU squared and residuals work row by row: the matmuls, attention and the mixer's kernel decide
    row_keys = MAMBA_LINEAR + ATTN_LINEAR + MLP_LINEAR

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        cfg = self.config
        h = rms_norm(x, w["norm"], cfg.rms_eps)
        kind = cfg.layer_types[i]
        if kind == ATTENTION and attn is not None:
            h = self._attention(i, w, h, attn)
        elif kind == MLP:
            h = linear(torch.relu(linear(h, w["mlp.up_proj.weight"])).square(), w["mlp.down_proj.weight"])
        else:
            T = h.shape[1]
            h = mixer(cfg.mamba, w, h, state[f"layers.{i}.conv"], state[f"layers.{i}.ssm"], self.ssd_chunk,
                      self.fused_decode, T > 1 and self.rows_alone(T))  # fmt: skip
        return x + h
