"""Llama: the forward pass, written against `KVBatch` (see wkvm/models/kv.py) so the engine can hand it paged caches.

A decoder layer is grouped-query attention with RoPE, then a SiLU-gated MLP, each behind a pre-RMSNorm. State per
layer i: `layers.{i}.k` / `layers.{i}.v`, one [Hkv, D] entry per cached token (kind "kv"); keys are cached after
RoPE. Raw tensor names are the HF `LlamaForCausalLM` names whatever the file format (GGUF is renamed on reading).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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
    layer_count,
    matrix_shape,
    only,
    require,
    resident,
    shape_of,
)
from wkvm.models.fused import (
    add_rms_norm,
    cpu_fp32,
    llama_layer,
    llama_layers,
    rms_norm,
    silu_mul,
)
from wkvm.models.kv import Attn, kv_tensors
from wkvm.models.linear import linear, stored
from wkvm.models.provider import ResidentWeights, Tensors, WeightProvider
from wkvm.models.rope import frequencies
from wkvm.models.spec import State, StateSpec

FAMILY = "llama"
ROPE_TYPES = ("default", "linear", "llama3")

EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# raw names under layer_prefix(i)
ATTN_RAW = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
MLP_RAW = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
NORM_RAW = ("input_layernorm.weight", "post_attention_layernorm.weight")
LAYER_RAW = ATTN_RAW + MLP_RAW + NORM_RAW
# compute-form names of the matrices that go through `linear`
LINEAR = ("self_attn.qkv", "self_attn.o_proj.weight", "mlp.gate_up", "mlp.down_proj.weight")

@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_embd: int
    vocab_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_factor: float = 1.0  # linear and llama3
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_context: int = 8192  # llama3
    tied_head: bool = False
    rms_eps: float = 1e-6
    max_context: int | None = None  # max_position_embeddings (GGUF: llama.context_length)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(f"RoPE scaling {self.rope_type!r} is not supported (known: {', '.join(ROPE_TYPES)})")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim {self.head_dim} is odd: RoPE rotates pairs")

    @staticmethod
    def from_hf(raw: RawTensors, hf: dict[str, Any]) -> LlamaConfig:
        """Dimensions from the tensors; heads, RoPE and eps from config.json (transformers 5's `rope_parameters`
        or the older `rope_theta` + `rope_scaling`)."""
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise CheckpointError(f"Llama config.json sets {flag}: biased projections are not supported")
        check_silu(hf, "Llama")
        window, context = hf.get("sliding_window"), hf.get("max_position_embeddings")
        if hf.get("model_type") == "mistral" and window is not None and not (context and int(window) >= int(context)):
            raise CheckpointError(f"Mistral config.json sets sliding_window {window} (below max_position_embeddings "
                                  f"{context}): sliding-window attention is not supported; Mistral 7B v0.2 and later "
                                  "set it to null")  # fmt: skip
        if any(k.endswith(".bias") for k in raw):
            raise CheckpointError("Llama checkpoint has bias tensors: biased projections are not supported")
        require(raw, [EMBED, FINAL_NORM] + [f"model.layers.0.{k}" for k in LAYER_RAW], "Llama")
        vocab, embd = matrix_shape(raw, EMBED, "Llama")
        check_dims(raw, {"model.layers.0.mlp.gate_proj.weight": 2}, "Llama")  # the FFN size is read from it
        try:
            heads = int(hf["num_attention_heads"])
            kv_heads = int(hf.get("num_key_value_heads") or heads)
        except KeyError as e:
            raise CheckpointError(f"Llama config.json lacks {e}") from None
        # transformers' order: a legacy rope_scaling (added by hand beside transformers 5's rope_parameters) wins, its
        # theta from the top level (read the other way round it had run plain RoPE; family hunt, session 49)
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise CheckpointError("partial rotary embeddings are not supported")
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        n_layer = layer_count(raw, "model.layers.")
        check_layer_count(hf, n_layer, "Llama")
        # llama3's original context: transformers 5 takes the top-level key first, then the scaling's, then the
        # model's context (8,192 had been assumed where both were absent)
        original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        cfg = LlamaConfig(
            n_layer=n_layer,
            n_embd=embd, vocab_size=vocab, ffn_size=shape_of(raw, "model.layers.0.mlp.gate_proj.weight")[0],
            n_heads=heads, n_kv_heads=kv_heads, head_dim=int(hf.get("head_dim") or embd // heads),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_context=int(original or hf.get("max_position_embeddings") or 8192),
            # an eps <= 0 had been reported as the checkpoint's NaN, a context of -1 had failed every request
            # (loading hunt, session 49)
            tied_head=HEAD not in raw, rms_eps=config_eps(hf, "rms_norm_eps", 1e-6, "Llama"),
            max_context=config_context(hf, "max_position_embeddings", "Llama"),
        )  # fmt: skip
        q, k = (shape_of(raw, f"model.layers.0.self_attn.{p}_proj.weight") for p in "qk")
        if q[0] != heads * cfg.head_dim or k[0] != kv_heads * cfg.head_dim:
            raise CheckpointError(f"Llama q/k projections {list(q)}/{list(k)} do not fit {heads} query and "
                                  f"{kv_heads} key/value heads of {cfg.head_dim}")  # fmt: skip
        check_shapes(raw, expected_shapes(cfg), "Llama")
        return cfg


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every raw tensor's shape for `cfg` (HF's [out, in] matrices)."""
    c, q, kv, f = cfg.n_embd, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, c), HEAD: (cfg.vocab_size, c), FINAL_NORM: (c,)}
    layer = {"self_attn.q_proj.weight": (q, c), "self_attn.k_proj.weight": (kv, c), "self_attn.v_proj.weight": (kv, c),
             "self_attn.o_proj.weight": (c, q), "mlp.gate_proj.weight": (f, c), "mlp.up_proj.weight": (f, c),
             "mlp.down_proj.weight": (c, f), "input_layernorm.weight": (c,), "post_attention_layernorm.weight": (c,)}
    for i in range(cfg.n_layer):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """RoPE's per-pair angular frequencies [D/2], scaled as transformers' `ROPE_INIT_FUNCTIONS` scale them."""
    f = frequencies(cfg.rope_theta, cfg.head_dim)
    if cfg.rope_type == "linear":
        return f / cfg.rope_factor
    if cfg.rope_type == "llama3":
        low_wavelen = cfg.rope_original_context / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_context / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / f
        scaled = torch.where(wavelen > low_wavelen, f / cfg.rope_factor, f)
        smooth = (cfg.rope_original_context / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return f


def state_spec(cfg: LlamaConfig) -> StateSpec:
    tensors = [t for i in range(cfg.n_layer) for t in kv_tensors(i, cfg.n_kv_heads, cfg.head_dim)]
    return StateSpec(FAMILY, tuple(tensors))


def global_keys(cfg: LlamaConfig) -> tuple[str, ...]:
    return (EMBED, FINAL_NORM) if cfg.tied_head else (EMBED, FINAL_NORM, HEAD)


def used_tensors(raw: RawTensors) -> RawTensors:
    n_layer = 1 + max((int(k.split(".")[2]) for k in raw if k.startswith("model.layers.")), default=-1)
    keep = {EMBED, FINAL_NORM, HEAD}  # HEAD is absent from a tied checkpoint's raw tensors
    for i in range(n_layer):
        keep.update(f"model.layers.{i}.{k}" for k in LAYER_RAW)
    return only(raw, keep)


def prepare_layer(
    raw: RawTensors, i: int, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: q, k, v fused into one [out, in] matrix, gate and up fused; matrices in `dtype`,
    norms fp32."""
    p = f"model.layers.{i}."
    require(raw, [p + k for k in LAYER_RAW], "Llama")
    r = {k: raw[p + k].to(device=device, dtype=torch.float32) for k in LAYER_RAW}
    t: Tensors = {
        "input_norm": r["input_layernorm.weight"],
        "post_norm": r["post_attention_layernorm.weight"],
        "self_attn.qkv": torch.cat([r[f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "self_attn.o_proj.weight": r["self_attn.o_proj.weight"],
        "mlp.gate_up": torch.cat([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
        "mlp.down_proj.weight": r["mlp.down_proj.weight"],
    }
    for k in LINEAR:
        t[k] = stored(t[k], dtype)
    return compute_form(t, LINEAR, pack)


def prepare_globals(raw: RawTensors, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    """Embedding (in `dtype`), final norm, head (prepacked; the embedding itself when tied)."""
    require(raw, global_keys(cfg), "Llama")
    embed, head = embedding_and_head(raw, EMBED, HEAD, cfg.tied_head, dtype, device)
    return resident({EMBED: embed, "final_norm": raw[FINAL_NORM].to(device=device, dtype=torch.float32), HEAD: head})


Pools = tuple[list[torch.Tensor], list[torch.Tensor]]  # the layers' key pools and value pools
# a group's rows for the one-call layers: x [rows, 1, C], cos, sin, its pools, the rows' page table and lengths, the
# page size
FusedRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Pools, torch.Tensor, torch.Tensor, int]


def same_pools(a: Pools, b: Pools) -> bool:
    """Whether two groups' layers' key and value pools are the same tensors."""
    return all(x is y for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))


@dataclass(frozen=True)
class Stack:
    """Every layer's tensors and kernel for `fused.llama_layers`: two norms and four matrices a layer, one kernel
    namespace with eight arguments a layer."""

    norms: list[torch.Tensor]
    mats: list[torch.Tensor]
    kernel: tuple[str, list[int]]


class Llama(ModelBase):
    family = FAMILY
    embed_key = EMBED
    config: LlamaConfig

    def __init__(self, cfg: LlamaConfig, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, state_spec(cfg), weights, model_fingerprint, device)
        self.inv_freq = inv_freq(cfg).to(self.device)
        self.kv_layers = tuple(range(cfg.n_layer))
        self._stacks: dict[int, Stack | None] = {}

    # norms, RoPE, SiLU and residuals work row by row: the matmuls and attention decide (`ModelBase.rows_alone`)
    row_keys = LINEAR

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g["final_norm"], self.config.rms_eps), g[HEAD])

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        assert attn is not None  # every Llama layer is attention
        eps = self.config.rms_eps
        if x.shape[1] == 1 and (y := self._fused_block(i, w, x, attn)) is not None:
            return y
        x, h = add_rms_norm(x, self._attention(i, w, rms_norm(x, w["input_norm"], eps), attn), w["post_norm"], eps)
        return x + self._mlp(w, h)

    def decode_groups(self, xs: list[torch.Tensor], states: list[State],
                      attns: list[Attn | None]) -> list[torch.Tensor | None]:  # fmt: skip
        """The groups' layers in one native call (`fused.llama_layers`: `_fused_block`'s call for each layer, so the
        same bits) where the weights are resident, every layer's matrices run on one native kernel and the attention
        on the fused pages; None for the groups that cannot. Layer by layer, the Python between layers cost ~0.35 ms
        of a ~5 ms one-stream SmolLM2 int8 step (this call: 1.074x paired; session 43, AMD EPYC Zen 4). Every group
        that can goes into the one call, its tokens as rows (a decode's, a checked draft's, a prompt chunk's where its
        rows are alone): the weights are read once a step, not once a group."""
        out: list[torch.Tensor | None] = [None] * len(xs)
        if not isinstance(self.weights, ResidentWeights):  # streamed layers go one by one
            return out
        parts = [(j, r) for j, (x, attn) in enumerate(zip(xs, attns, strict=True))
                 if (r := self._fused_rows(x, attn)) is not None]  # fmt: skip
        if not parts:
            return out
        # their pages are all in one pool: only the engine's paged caches run attention on the fused kernel
        assert all(same_pools(r[3], parts[0][1][3]) for _, r in parts), "groups with pages in different pools"
        y = self._layers_call([r for _, r in parts])
        if y is None:
            return out
        start = 0
        for j, _ in parts:
            B, T = xs[j].shape[:2]
            out[j] = y[start : start + B * T].view(B, T, -1)
            start += B * T
        return out

    def _layers_call(self, parts: list[FusedRows]) -> torch.Tensor | None:
        """`fused.llama_layers` on the rows of `parts` (pages in one pool), in order; None where no native kernel runs
        them."""
        stack = self._stack(sum(p[0].shape[0] for p in parts))
        if stack is None:
            return None
        if len(parts) == 1:  # a step's usual one group: its own tensors, no copies
            x, cos, sin, pools, table, lengths, page = parts[0]
        else:
            width = max(p[4].shape[1] for p in parts)
            table = torch.cat([F.pad(p[4], (0, width - p[4].shape[1])) for p in parts])
            x, cos, sin, lengths = (torch.cat([p[k] for p in parts]) for k in (0, 1, 2, 5))  # type: ignore[misc]
            pools, page = parts[0][3], parts[0][6]
        cfg = self.config
        return llama_layers(x.contiguous(), stack.norms, stack.mats, stack.kernel, cfg.rms_eps, cos, sin, pools,
                            (table, lengths, page), cfg.head_dim**-0.5, (cfg.n_heads, cfg.n_kv_heads))  # fmt: skip

    def _fused_rows(self, x: torch.Tensor, attn: Attn | None) -> FusedRows | None:
        """A group's tokens as the one-call layers take them: each token a row of its own (a decode's one token a row;
        several, where `token_rows`: every layer computes a row alone), its pages the row's and its length the row's
        before it, as `PagedKV.rope_attend` runs them (every key and value is written before any row attends)."""
        B, T = x.shape[:2]
        if attn is None or not (T == 1 or attn.token_rows) or not cpu_fp32(x):
            return None
        cos, sin = (a if T == 1 else a.reshape(B * T, 1, *a.shape[2:]) for a in (attn.cos, attn.sin))
        cfg = self.config
        keys, values, step = [], [], None
        for i in range(cfg.n_layer):
            if (pages := attn.kv.fused_pages(i, cfg.head_dim, cos, sin)) is None:
                return None
            keys.append(pages[0])
            values.append(pages[1])
            step = pages[2:]
        assert step is not None  # a model has layers
        return x.reshape(B * T, 1, -1), cos, sin, (keys, values), step[0], step[1], step[2]

    def _stack(self, rows: int) -> Stack | None:
        """Every layer's norms, matrices and kernel arguments at `rows` rows, gathered once (resident weights are
        fixed); None unless one native kernel runs every layer's matrices."""
        if rows not in self._stacks:
            norms: list[torch.Tensor] = []
            mats: list[torch.Tensor] = []
            names, args = set(), []
            for i in range(self.config.n_layer):
                w = self.weights.layer(i)
                layer = [w[k] for k in LINEAR]
                kernel = self.layer_kernel(i, layer, rows)
                names.add(kernel[0] if kernel else None)
                args += kernel[1] if kernel else []
                norms += [w["input_norm"], w["post_norm"]]
                mats += layer
            one = names.pop() if len(names) == 1 else None
            self._stacks[rows] = Stack(norms, mats, (one, args)) if one else None
        return self._stacks[rows]

    def _fused_block(self, i: int, w: Tensors, x: torch.Tensor, attn: Attn) -> torch.Tensor | None:
        """A decode step's layer in one call (`fused.llama_layer`: the same bits) where its matmuls all run on one
        native int8 / int4 kernel and its attention on the fused pages; else None."""
        cfg = self.config
        mats = [w[k] for k in LINEAR]
        kernel = self.layer_kernel(i, mats, x.shape[0])
        if kernel is None or not cpu_fp32(x):
            return None
        pages = attn.kv.fused_pages(i, cfg.head_dim, attn.cos, attn.sin)
        if pages is None:
            return None
        return llama_layer(x.contiguous(), (w["input_norm"], w["post_norm"]), mats, kernel, cfg.rms_eps, attn.cos,
                           attn.sin, pages, cfg.head_dim**-0.5, (cfg.n_heads, cfg.n_kv_heads))  # fmt: skip

    def _attention(self, i: int, w: Tensors, x: torch.Tensor, attn: Attn) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = torch.split(linear(x, w["self_attn.qkv"]), [Hq * D, Hkv * D, Hkv * D], -1)
        o = attn.rope_attend(i, q.reshape(B, T, Hq, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D), D**-0.5)
        return linear(o.reshape(B, T, Hq * D), w["self_attn.o_proj.weight"])

    @staticmethod
    def _mlp(w: Tensors, x: torch.Tensor) -> torch.Tensor:
        return linear(silu_mul(linear(x, w["mlp.gate_up"])), w["mlp.down_proj.weight"])
