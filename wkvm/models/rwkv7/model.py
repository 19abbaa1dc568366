"""RWKV-7 "Goose" (x070): the forward pass, written like the paper, state explicit.

State per layer i: `layers.{i}.att_shift` [C], `layers.{i}.wkv` [H, N, N] (value x key), `layers.{i}.ffn_shift` [C].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from wkvm.models import fused
from wkvm.models.family import (
    STEP_CHUNK,
    CheckpointError,
    ModelBase,
    RawTensors,
    check_dims,
    check_shapes,
    compute_form,
    config_eps,
    each_group,
    layer_count,
    matrix_shape,
    no_attention,
    require,
    resident,
    shape_of,
)
from wkvm.models.kv import KVBatch
from wkvm.models.linear import embedding, linear, pack_linear, rows_independent, stored, stored_outer
from wkvm.models.provider import ResidentWeights, Tensors, WeightProvider
from wkvm.models.rwkv7 import step
from wkvm.models.rwkv7.wkv import DEFAULT_CHUNK, wkv_chunked, wkv_step
from wkvm.models.spec import State, StateSpec, TensorSpec

FAMILY = "rwkv7"
DECAY_SCALE = 0.606531  # exp(-0.5), as in BlinkDL's reference
MIX = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
LAYER_KEYS = (
    *(f"att.{m}" for m in MIX),
    *(f"att.{p}{j}" for p in "wag" for j in "012" if p + j != "g0"),
    "att.k_k", "att.k_a", "att.r_k",
    "att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
    "att.ln_x.weight", "att.ln_x.bias",
    "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias",
    "ffn.x_k", "ffn.key.weight", "ffn.value.weight",
)  # fmt: skip
LINEAR_KEYS = (
    "att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
    "ffn.key.weight", "ffn.value.weight",
)  # fmt: skip
LORA_KEYS = tuple(f"att.{p}{j}" for p in "wavg" for j in "12")
STEP_LAYER_KEYS = (  # step.cpp's `layer` takes a layer's tensors in this order (the att.v LoRA's are None in layer 0)
    "ln1.weight", "ln1.bias", "att.mix", "att.receptance.weight", "att.key.weight", "att.value.weight",
    *(f"att.{p}{j}" for p in "wagv" for j in "120" if p + j != "g0"), "att.k_k", "att.k_a", "att.r_k",
    "att.ln_x.weight", "att.ln_x.bias", "att.output.weight", "ln2.weight", "ln2.bias", "ffn.x_k", "ffn.key.weight",
    "ffn.value.weight",
)  # fmt: skip
PACKED_LORA_MIN_ROWS = 64
# r, k, v, decay, a, g and the value residual's mix (None in layer 0): `_projections`
Projections = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                    torch.Tensor | None]  # fmt: skip
GLOBAL_KEYS = ("emb.weight", "blocks.0.ln0.weight", "blocks.0.ln0.bias", "ln_out.weight", "ln_out.bias", "head.weight")


@dataclass(frozen=True)
class RWKV7Config:
    n_layer: int
    n_embd: int
    n_head: int
    head_size: int
    vocab_size: int
    ffn_size: int
    decay_rank: int
    a_rank: int
    v_rank: int
    gate_rank: int
    ln_eps: float = 1e-5
    gn_eps: float = 64e-5

    @staticmethod
    def from_tensors(raw: RawTensors, hf: dict[str, Any] | None = None) -> RWKV7Config:
        require(raw, GLOBAL_KEYS, "RWKV-7")
        require(raw, ["blocks.0.att.r_k", "blocks.0.ffn.key.weight", "blocks.0.att.w1", "blocks.0.att.a1",
                      "blocks.0.att.g1"], "RWKV-7")  # fmt: skip
        vocab, embd = matrix_shape(raw, "emb.weight", "RWKV-7")
        n_head, head_size = matrix_shape(raw, "blocks.0.att.r_k", "RWKV-7")
        n_layer = layer_count(raw, "blocks.")
        hf = hf or {}
        eps = config_eps(hf, "norm_eps", 1e-5, "RWKV-7")  # 0 or "x": refused by name (loading hunt, session 49)
        # rounded so that 64 * 1e-5 and 64e-5 fingerprint alike
        gn_eps = round(config_eps(hf, "wkvm_group_norm_eps", head_size * eps, "RWKV-7") if hf else 64e-5, 12)
        if n_head * head_size != embd:
            raise CheckpointError(f"RWKV-7 blocks.0.att.r_k is [{n_head}, {head_size}]: {n_head} heads of {head_size} "
                                  f"do not make the width {embd}")  # fmt: skip
        check_dims(raw, {k: 2 for k in ("blocks.0.ffn.key.weight", "blocks.0.att.w1", "blocks.0.att.a1",
                                         "blocks.1.att.v1", "blocks.0.att.g1")}, "RWKV-7")  # fmt: skip
        cfg = RWKV7Config(
            n_layer=n_layer, n_embd=embd, n_head=n_head, head_size=head_size, vocab_size=vocab,
            ffn_size=shape_of(raw, "blocks.0.ffn.key.weight")[0],
            decay_rank=shape_of(raw, "blocks.0.att.w1")[1], a_rank=shape_of(raw, "blocks.0.att.a1")[1],
            v_rank=shape_of(raw, "blocks.1.att.v1")[1] if n_layer > 1 else 0,
            gate_rank=shape_of(raw, "blocks.0.att.g1")[1], ln_eps=eps, gn_eps=gn_eps,
        )  # fmt: skip
        check_shapes(raw, expected_shapes(raw, cfg), "RWKV-7")
        return cfg


VECTOR_KEYS = (  # a layer's [C] vectors (BlinkDL's files hold most as [1, 1, C])
    *(f"att.{m}" for m in MIX), "att.w0", "att.a0", "att.v0", "att.k_k", "att.k_a", "att.ln_x.weight", "att.ln_x.bias",
    "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "ffn.x_k",
)  # fmt: skip


def expected_shapes(raw: RawTensors, cfg: RWKV7Config) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape for `cfg`: a layer whose tensor differs from layer 0's had failed in torch naming no
    tensor, or (a layer's r_k of [8, 8] where layer 0's was [4, 16]) been reshaped silently into another model. A
    vector keeps whatever leading 1s the file gives it."""
    C, V, F = cfg.n_embd, cfg.vocab_size, cfg.ffn_size

    def vector(name: str) -> tuple[int, ...]:
        shape = shape_of(raw, name) if name in raw else (C,)
        return (*shape[:-1], C) if all(d == 1 for d in shape[:-1]) else (C,)

    shapes: dict[str, tuple[int, ...]] = {"emb.weight": (V, C), "head.weight": (V, C)}
    shapes.update({k: vector(k) for k in ("blocks.0.ln0.weight", "blocks.0.ln0.bias", "ln_out.weight", "ln_out.bias")})
    ranks = {"w": cfg.decay_rank, "a": cfg.a_rank, "v": cfg.v_rank, "g": cfg.gate_rank}
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        shapes.update({p + k: vector(p + k) for k in VECTOR_KEYS if i > 0 or k != "att.v0"})
        shapes.update({p + f"att.{k}.weight": (C, C) for k in ("receptance", "key", "value", "output")})
        shapes.update({p + "att.r_k": (cfg.n_head, cfg.head_size), p + "ffn.key.weight": (F, C),
                       p + "ffn.value.weight": (C, F)})  # fmt: skip
        for x, rank in ranks.items():
            if i > 0 or x != "v":  # layer 0 has no value residual (a file's v1 / v2 there go unused)
                shapes.update({p + f"att.{x}1": (C, rank), p + f"att.{x}2": (rank, C)})
    return shapes


def used_tensors(raw: RawTensors) -> RawTensors:
    """Everything but layer 0's v0/v1/v2, which BlinkDL files may carry and the model never uses."""
    return {k: v for k, v in raw.items() if k not in ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2")}


def rwkv7_state_spec(cfg: RWKV7Config) -> StateSpec:
    C, H, N = cfg.n_embd, cfg.n_head, cfg.head_size
    tensors: list[TensorSpec] = []
    for i in range(cfg.n_layer):
        tensors += [
            TensorSpec(f"layers.{i}.att_shift", (C,), kind="shift"),
            TensorSpec(f"layers.{i}.wkv", (H, N, N), kind="recurrent"),
            TensorSpec(f"layers.{i}.ffn_shift", (C,), kind="shift"),
        ]
    return StateSpec(FAMILY, tuple(tensors))


def prepare_layer(
    raw: RawTensors, i: int, cfg: RWKV7Config, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i's tensors in compute form: vectors flat, mixing coefficients stacked; `pack` prepacks the
    matrices for oneDNN (worth it for resident weights, not for a layer used once and dropped). `dtype` is the
    storage of the six large matrices (float32, bfloat16 or int8); everything else, and all arithmetic, stays fp32."""
    p = f"blocks.{i}."
    keys = list(LAYER_KEYS) + ([f"att.v{j}" for j in "012"] if i > 0 else [])
    require(raw, [p + k for k in keys], "RWKV-7")
    t = {k: stored(raw[p + k].to(device), dtype) if k in LINEAR_KEYS else raw[p + k].to(device, torch.float32)
         for k in keys}  # fmt: skip
    for k in ("att.w0", "att.a0", "att.v0", "att.k_k", "att.k_a", "ffn.x_k", *(f"att.{m}" for m in MIX)):
        if k in t:
            t[k] = t[k].reshape(-1)
    t["att.r_k"] = t["att.r_k"].reshape(cfg.n_head, cfg.head_size)
    t["att.mix"] = torch.stack([t.pop(f"att.{m}") for m in MIX]).view(6, 1, 1, -1)
    t = compute_form(t, LINEAR_KEYS, pack)
    for k in LORA_KEYS if pack else ():  # for many rows a packed copy is faster; for a few, plain x @ W (both measured)
        if k in t and (packed := pack_linear(t[k].t())).is_mkldnn:
            t[k + ".packed"] = packed
    return t


class RWKV7(ModelBase):
    family = FAMILY
    config: RWKV7Config
    head_key = "head.weight"

    def __init__(
        self, cfg: RWKV7Config, weights: WeightProvider, model_fingerprint: str, device: torch.device | str = "cpu"
    ):
        super().__init__(cfg, rwkv7_state_spec(cfg), weights, model_fingerprint, device)
        self.wkv_chunk = DEFAULT_CHUNK

    @functools.cached_property
    def chunks_equal_steps(self) -> bool:
        """`_steps_layer` runs short chunks (the step kernel) on matmuls whose rows do not mix: resident weights
        (streamed layers are kept unpacked for oneDNN), checked on layer 0."""
        if not isinstance(self.weights, ResidentWeights) or not step.available():
            return False
        w = self.weights.layer(0)
        return all(rows_independent(w[name], STEP_CHUNK) for name in LINEAR_KEYS)

    def rows_alone(self, rows: int) -> bool:
        """Whether a chunk of `rows` tokens runs `_steps_layer` with matmuls that give each row its own bits
        (`forward_groups`' rule, as layer 0's matrices decide), so that it has stepping's bits."""
        if not (self.device.type == "cpu" and step.available()):
            return False
        if rows > 1 and self._layer_in_one_call(0, self.weights.layer(0), rows) is not None:
            return True
        return rows <= STEP_CHUNK and rows < PACKED_LORA_MIN_ROWS and self.chunks_equal_steps

    @torch.inference_mode()
    def forward_groups(
        self, groups: Sequence[tuple[torch.Tensor, State]], all_logits: bool | Sequence[bool] = False,
        caches: Sequence[KVBatch] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """As ModelBase's, with each group's layer-0 value (v_first) carried into every later layer."""
        no_attention(self, caches)
        cfg, g = self.config, self.weights.globals()
        xs, v_firsts = [], []
        for tokens, _ in groups:
            x = embedding(tokens.to(self.device), g["emb.weight"])
            xs.append(F.layer_norm(x, (cfg.n_embd,), g["blocks.0.ln0.weight"], g["blocks.0.ln0.bias"], cfg.ln_eps))
            v_firsts.append(xs[-1])  # replaced by layer 0's v
        for i in range(cfg.n_layer):
            w = self.weights.layer(i)
            for j, (tokens, state) in enumerate(groups):
                x = xs[j]
                # one token per row on the step kernel; without it (WKVM_FUSED=off, no compiler) the torch path below
                if x.is_cpu and step.available():
                    few, T = tokens.numel() < PACKED_LORA_MIN_ROWS, tokens.shape[1]
                    if T == 1 and few:
                        y, v_firsts[j] = self._decode_layer(i, w, x.view(x.shape[0], -1), state, v_firsts[j])
                        xs[j] = y.view(x.shape)
                        continue
                    # several tokens a row: exactly as many steps, op by op for a few (up to STEP_CHUNK in under 64
                    # rows), in one call for any number where the layer's matrices are on one native kernel at that
                    # many rows (stepping's bits, so a resumed prompt answers as an uninterrupted one; faster than
                    # the chunked path below too)
                    one_call = T > 1 and self._layer_in_one_call(i, w, tokens.numel()) is not None
                    if T > 1 and (few and T <= STEP_CHUNK or one_call):
                        xs[j], v_firsts[j] = self._steps_layer(i, w, x, state, v_firsts[j])
                        continue
                xx = F.layer_norm(x, (cfg.n_embd,), w["ln1.weight"], w["ln1.bias"], cfg.ln_eps)
                att, v_firsts[j] = self._time_mix(i, w, xx, state, v_firsts[j])
                x = x + att
                xx = F.layer_norm(x, (cfg.n_embd,), w["ln2.weight"], w["ln2.bias"], cfg.ln_eps)
                xs[j] = x + self._channel_mix(w, xx, state[f"layers.{i}.ffn_shift"])
        out = []
        for x, every in zip(xs, each_group(all_logits, len(groups)), strict=True):
            x = x if every else x[:, -1]
            x = F.layer_norm(x, (cfg.n_embd,), g["ln_out.weight"], g["ln_out.bias"], cfg.ln_eps)
            out.append(linear(x, g["head.weight"]))
        return out

    # --- blocks --------------------------------------------------------------------------------
    def _decode_layer(
        self, i: int, w: Tensors, x: torch.Tensor, state: State, v_first: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i for one token per row (x [B, C]): `_time_mix` and `_channel_mix` in step.py's fused ops, so that
        little but the matmuls is left outside them (issue #21). Returns x and v_first."""
        cfg = self.config
        if (kernel := self._layer_in_one_call(i, w, x.shape[0])) is not None:
            shifts = state[f"layers.{i}.att_shift"], state[f"layers.{i}.wkv"], state[f"layers.{i}.ffn_shift"]
            return step.layer(x, v_first, *shifts, [w.get(k) for k in STEP_LAYER_KEYS], kernel, cfg.ln_eps,
                              cfg.gn_eps)  # fmt: skip
        _, (xr, xw, xk, xv, xa, xg) = step.norm_shift_mix(x, None, w["ln1.weight"], w["ln1.bias"], cfg.ln_eps,
                                                          state[f"layers.{i}.att_shift"], w["att.mix"])  # fmt: skip
        r, k, v, decay, a, g, v_mix = self._projections(i, w, xr, xw, xk, xv, xa, xg)
        v_first = v if i == 0 else v_first
        o, v = step.wkv(state[f"layers.{i}.wkv"], r, decay, k, v, v_first, v_mix, a, g, w, cfg.gn_eps)
        x, (xk,) = step.norm_shift_mix(x, linear(o, w["att.output.weight"]), w["ln2.weight"], w["ln2.bias"],
                                       cfg.ln_eps, state[f"layers.{i}.ffn_shift"], w["ffn.x_k"])  # fmt: skip
        x = x + linear(step.relu_square(linear(xk, w["ffn.key.weight"])), w["ffn.value.weight"])
        return x, v_first

    def _projections(self, i: int, w: Tensors, xr: torch.Tensor, xw: torch.Tensor, xk: torch.Tensor,
                     xv: torch.Tensor, xa: torch.Tensor, xg: torch.Tensor) -> Projections:  # fmt: skip
        """A time mix's matmuls and LoRA chains on rows of mixed inputs (the step kernel's): r, k, v, the decay, the
        in-context rate a, the gate g and the value residual's mix (None in layer 0)."""
        r = linear(xr, w["att.receptance.weight"])
        k = linear(xk, w["att.key.weight"])
        v = linear(xv, w["att.value.weight"])
        lora = "wagv" if i > 0 else "wag"  # decay, in-context rate, gate, value residual (not in layer 0)
        decay, a, g, *v_mix = step.loras(
            [xw, xa, xg, xv][: len(lora)], [w[f"att.{p}1"] for p in lora], [w[f"att.{p}2"] for p in lora],
            [w["att.w0"], w["att.a0"], None, w.get("att.v0")][: len(lora)],
            inner=[step.TANH, step.NONE, step.SIGMOID, step.NONE][: len(lora)],
            outer=[step.SIGMOID, step.SIGMOID, step.NONE, step.SIGMOID][: len(lora)],
        )  # fmt: skip
        return r, k, v, decay, a, g, v_mix[0] if v_mix else None

    def _layer_in_one_call(self, i: int, w: Tensors, rows: int) -> tuple[str, list[int]] | None:
        """The native kernel step.cpp's `layer` runs layer i's six matrices on for `rows` rows, or None where it cannot
        (the matrices on different kernels or on none, the LoRAs not fp32)."""
        if w["att.w1"].dtype != torch.float32:
            return None
        return self.layer_kernel(i, [w[k] for k in LINEAR_KEYS], rows)

    def _steps_layer(
        self, i: int, w: Tensors, x: torch.Tensor, state: State, v_first: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i for T tokens of each row (x [B, T, C]) with the same bits as T calls of `_decode_layer`: the ops
        that carry state from token to token (token shift, wkv) run a token at a time on the step kernel, the rest
        (matmuls, LoRA chains, relu^2: each row's arithmetic the same whatever the batch) over the B * T rows at once.
        A short chunk then equals stepping exactly, also where a rounding in int8 / int4 kernels would amplify a
        last-bit difference: a moved stream catching up on tokens its source generated (`Engine.precopy`) gives the
        tokens an unmoved one does. Returns x and v_first ([B, T, C], as `_time_mix`'s)."""
        cfg, (B, T, C) = self.config, x.shape
        att_shift, ffn_shift = state[f"layers.{i}.att_shift"], state[f"layers.{i}.ffn_shift"]
        if (kernel := self._layer_in_one_call(i, w, B * T)) is not None:  # the same ops in one call
            y, v = step.layer(x.reshape(B * T, C), v_first.reshape(B * T, C), att_shift, state[f"layers.{i}.wkv"],
                              ffn_shift, [w.get(k) for k in STEP_LAYER_KEYS], kernel, cfg.ln_eps, cfg.gn_eps, T)
            return y.view(B, T, C), v.view(B, T, C)

        def by_token(fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
            """fn(t) -> ([B, C], [M, B, C]) per token, stacked as ([B * T, C], [M, B * T, C])."""
            pairs = [fn(t) for t in range(T)]
            first, second = (torch.stack([p[n] for p in pairs], -2) for n in (0, 1))
            return first.view(B * T, C), second.view(-1, B * T, C)

        def token(rows: torch.Tensor, t: int) -> torch.Tensor:
            return rows.view(B, T, C)[:, t]

        _, mixed = by_token(lambda t: step.norm_shift_mix(x[:, t], None, w["ln1.weight"], w["ln1.bias"], cfg.ln_eps,
                                                          att_shift, w["att.mix"]))  # fmt: skip
        xr, xw, xk, xv, xa, xg = mixed
        r, k, v, decay, a, g, mix = self._projections(i, w, xr, xw, xk, xv, xa, xg)
        v_first = v if i == 0 else v_first.reshape(B * T, C)
        S = state[f"layers.{i}.wkv"]
        o, _ = by_token(lambda t: step.wkv(S, token(r, t), token(decay, t), token(k, t), token(v, t),
                                           token(v_first, t), None if mix is None else token(mix, t), token(a, t),
                                           token(g, t), w, cfg.gn_eps))  # fmt: skip
        att = linear(o, w["att.output.weight"])
        s, xk = by_token(lambda t: step.norm_shift_mix(x[:, t], token(att, t), w["ln2.weight"], w["ln2.bias"],
                                                       cfg.ln_eps, ffn_shift, w["ffn.x_k"]))  # fmt: skip
        y = s + linear(step.relu_square(linear(xk[0], w["ffn.key.weight"])), w["ffn.value.weight"])
        return y.view(B, T, C), v_first.view(B, T, C)

    def _time_mix(
        self, i: int, w: Tensors, x: torch.Tensor, state: State, v_first: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        H, N = self.config.n_head, self.config.head_size
        shift = state[f"layers.{i}.att_shift"]
        prev = shift.unsqueeze(1) if T == 1 else torch.cat([shift.unsqueeze(1), x[:, :-1]], 1)
        xr, xw, xk, xv, xa, xg = torch.addcmul(x, prev - x, w["att.mix"])
        shift.copy_(x[:, -1])
        many = B * T >= PACKED_LORA_MIN_ROWS

        def lora(h: torch.Tensor, name: str) -> torch.Tensor:
            if not many:
                return h @ w[name]
            # a streamed layer has no packed copy: packed here, as `prepare_layer` packs a resident one (small
            # matrices; x @ W gave other bits, so a streamed prompt's logits were ~2e-6 from resident weights')
            packed = w.get(name + ".packed")
            packed = pack_linear(w[name].t()) if packed is None else packed
            return linear(h, packed) if packed.is_mkldnn else h @ w[name]

        r = linear(xr, w["att.receptance.weight"])
        k = linear(xk, w["att.key.weight"])
        v = linear(xv, w["att.value.weight"])
        decay = torch.sigmoid(w["att.w0"] + lora(torch.tanh(lora(xw, "att.w1")), "att.w2"))
        a = torch.sigmoid(w["att.a0"] + lora(lora(xa, "att.a1"), "att.a2"))
        g = lora(torch.sigmoid(lora(xg, "att.g1")), "att.g2")
        v_mix = None if i == 0 else torch.sigmoid(w["att.v0"] + lora(lora(xv, "att.v1"), "att.v2"))
        if T > 1 and fused.cpu_fp32(x) and step.available():  # the step kernel token by token: 5x the torch chunks
            v_first = v if i == 0 else v_first
            r, decay, k, v, vf, a, g = (t.reshape(B * T, C) for t in (r, decay, k, v, v_first, a, g))
            mix = None if v_mix is None else v_mix.reshape(B * T, C)
            o, _ = step.wkv(state[f"layers.{i}.wkv"], r, decay, k, v, vf, mix, a, g, w, self.config.gn_eps, tokens=T)
            return linear(o.view(B, T, C), w["att.output.weight"]), v_first
        log_w = decay * -DECAY_SCALE

        kk = F.normalize((k * w["att.k_k"]).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
        k = k * (1 + (a - 1) * w["att.k_a"])
        if v_mix is None:
            v_first = v
        else:
            v = v + (v_first - v) * v_mix

        o = self._wkv(state[f"layers.{i}.wkv"], r, log_w, k, v, -kk, kk * a)
        o = F.group_norm(o.reshape(B * T, C), H, w["att.ln_x.weight"], w["att.ln_x.bias"], self.config.gn_eps)
        bonus = ((r * k).view(B, T, H, N) * w["att.r_k"]).sum(-1, keepdim=True) * v.view(B, T, H, N)
        o = o.view(B, T, C) + bonus.view(B, T, C)
        return linear(o * g, w["att.output.weight"]), v_first

    def _wkv(
        self, S: torch.Tensor, r: torch.Tensor, log_w: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        a: torch.Tensor, b: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Run the recurrence on [B, T, C] inputs against S [B, H, N, N] (in place)."""
        B, T, C = r.shape
        H, N = self.config.n_head, self.config.head_size
        S_flat = S.view(B * H, N, N)
        if T == 1:
            o = wkv_step(S_flat, *(t.reshape(B * H, N) for t in (r, log_w, k, v, a, b)))
            return o.view(B, 1, C)
        hr, hw, hk, hv, ha, hb = (
            t.view(B, T, H, N).transpose(1, 2).reshape(B * H, T, N) for t in (r, log_w, k, v, a, b)
        )
        o = wkv_chunked(S_flat, hr, hw, hk, hv, ha, hb, chunk=self.wkv_chunk)
        return o.view(B, H, T, N).transpose(1, 2).reshape(B, T, C)

    def _channel_mix(self, w: Tensors, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        prev = shift.unsqueeze(1) if T == 1 else torch.cat([shift.unsqueeze(1), x[:, :-1]], 1)
        k = torch.addcmul(x, prev - x, w["ffn.x_k"])
        shift.copy_(x[:, -1])  # after use: for T == 1, prev is a view of shift
        k = torch.relu_(linear(k, w["ffn.key.weight"])).square_()
        return linear(k, w["ffn.value.weight"])


def prepare_globals(raw: RawTensors, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    """Embedding, first and last norms, head: in compute form (embedding and head stored in `dtype`)."""
    big = ("emb.weight", "head.weight")
    g = {k: stored_outer(raw[k].to(device), dtype) if k in big else raw[k].to(device, torch.float32)
         for k in GLOBAL_KEYS}  # fmt: skip
    for k in ("blocks.0.ln0.weight", "blocks.0.ln0.bias"):
        g[k] = g[k].reshape(-1)
    g["head.weight"] = pack_linear(g["head.weight"])
    return resident(g)
