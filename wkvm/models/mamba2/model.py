"""Mamba2: the forward pass, state explicit (the HF `Mamba2ForCausalLM` math, no fused kernels).

A block: x += out_proj(gated_norm(ssm(silu(conv(xBC))), z)) where in_proj(rms_norm(x)) = [z | xBC | dt],
xBC = [x | B | C]. State per layer i: `layers.{i}.conv` [conv_dim, K-1] (the last K-1 conv inputs, oldest first)
and `layers.{i}.ssm` [H, P, N] (head, head_dim, state). Logits have the checkpoint's (padded) vocab size.
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
    check_bias_flags,
    check_dims,
    check_layer_count,
    check_shapes,
    check_silu,
    compute_form,
    config_eps,
    embedding_and_head,
    layer_count,
    matrix_shape,
    positive_int,
    require,
    resident,
)
from wkvm.models.fused import rms_norm
from wkvm.models.kv import Attn
from wkvm.models.linear import linear, stored
from wkvm.models.mamba2.ssd import DEFAULT_CHUNK, kernel_available, mixer_steps, ssd_chunked, ssd_step
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.spec import State, StateSpec, TensorSpec

FAMILY = "mamba2"
PREFIX = "backbone.layers."
EMBEDDING = "backbone.embeddings.weight"
NORM_F = "backbone.norm_f.weight"
HEAD = "lm_head.weight"
LINEAR_KEYS = ("mixer.in_proj.weight", "mixer.out_proj.weight")
LAYER_KEYS = ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.dt_bias", "mixer.A_log",
              "mixer.D", "mixer.norm.weight", "mixer.out_proj.weight")  # fmt: skip
OPTIONAL_KEYS = ("mixer.in_proj.bias", "mixer.out_proj.bias", "mixer.conv1d.bias")


@dataclass(frozen=True)
class Mamba2Config:
    n_layer: int
    d_model: int
    d_inner: int  # n_heads * head_dim
    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    vocab_size: int  # the embedding's rows: the padded vocab
    tie_embeddings: bool
    norm_eps: float = 1e-5
    dt_min: float = 0.0
    dt_max: float | None = None  # None: no upper clamp of dt

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @staticmethod
    def from_tensors(raw: RawTensors, hf: dict[str, Any]) -> Mamba2Config:
        """Every size read from the tensors but n_groups (B and C's split), eps and the dt limit (config.json)."""
        p = PREFIX + "0."
        require(raw, [EMBEDDING, NORM_F, *(p + k for k in LAYER_KEYS)], "Mamba2")
        vocab, d_model = matrix_shape(raw, EMBEDDING, "Mamba2")
        check_dims(raw, {p + "mixer.A_log": 1, p + "mixer.out_proj.weight": 2, p + "mixer.conv1d.weight": 3,
                         p + "mixer.in_proj.weight": 2}, "Mamba2")  # fmt: skip
        n_heads = raw[p + "mixer.A_log"].shape[0]
        d_inner = raw[p + "mixer.out_proj.weight"].shape[1]
        conv_dim, _, d_conv = raw[p + "mixer.conv1d.weight"].shape
        n_groups = positive_int(hf, "n_groups", "Mamba2", 8)
        d_state = (conv_dim - d_inner) // (2 * n_groups)
        if d_inner % n_heads or conv_dim != d_inner + 2 * n_groups * d_state or d_conv < 2:
            raise CheckpointError(f"Mamba2: conv1d has {conv_dim} channels and kernel {d_conv}; expected "
                                  f"{d_inner} + 2 x {n_groups} groups x d_state, kernel >= 2")  # fmt: skip
        check_state_size(hf, "state_size", "n_groups", d_state, conv_dim, d_inner, "Mamba2")
        in_out = raw[p + "mixer.in_proj.weight"].shape[0]
        if in_out != d_inner + conv_dim + n_heads:
            raise CheckpointError(f"Mamba2: in_proj has {in_out} outputs, expected {d_inner + conv_dim + n_heads} "
                                  "(z, xBC, dt); a gated-MLP part (d_mlp > 0) is not supported")  # fmt: skip
        check_silu(hf, "Mamba2")
        n_layer = layer_count(raw, PREFIX)
        check_layer_count(hf, n_layer, "Mamba2")
        check_bias_flags(hf, raw, {"use_bias": p + "mixer.in_proj.bias", "use_conv_bias": p + "mixer.conv1d.bias"},
                         "Mamba2")  # fmt: skip
        dt_min, dt_max = time_step_limit(hf)
        cfg = Mamba2Config(
            n_layer=n_layer, d_model=d_model, d_inner=d_inner, n_heads=n_heads,
            head_dim=d_inner // n_heads, d_state=d_state, n_groups=n_groups, d_conv=d_conv, vocab_size=vocab,
            tie_embeddings=HEAD not in raw, norm_eps=config_eps(hf, "layer_norm_epsilon", 1e-5, "Mamba2"),
            dt_min=dt_min, dt_max=None if dt_max == float("inf") else dt_max,
        )  # fmt: skip
        shapes = {EMBEDDING: (vocab, d_model), HEAD: (vocab, d_model), NORM_F: (d_model,)}
        for i in range(n_layer):
            shapes.update({f"{PREFIX}{i}.norm.weight": (d_model,), **mixer_shapes(cfg, f"{PREFIX}{i}.mixer.")})
        check_shapes(raw, shapes, "Mamba2")
        return cfg


def mixer_shapes(cfg: Mamba2Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """The shapes of a Mamba2 mixer's raw tensors under `prefix` (this family and hybrids)."""
    c, d, h, n_in = cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.d_inner + cfg.conv_dim + cfg.n_heads
    shapes = {"in_proj.weight": (n_in, c), "in_proj.bias": (n_in,), "conv1d.weight": (cfg.conv_dim, 1, cfg.d_conv),
              "conv1d.bias": (cfg.conv_dim,), "dt_bias": (h,), "A_log": (h,), "D": (h,), "norm.weight": (d,),
              "out_proj.weight": (c, d), "out_proj.bias": (c,)}  # fmt: skip
    return {prefix + k: v for k, v in shapes.items()}


def check_state_size(hf: dict[str, Any], key: str, groups_key: str, d_state: int, conv_dim: int, d_inner: int,
                     what: str) -> None:  # fmt: skip
    """The config's state size (`state_size`, Bamba's `mamba_d_state`), where it gives one, is the one the conv's
    channels (d_inner + 2 x n_groups x d_state) give with its n_groups: a wrong n_groups had split B and C into other
    groups and run another model, silently (logits off by 1.4; transformers refuses the size mismatch; loading hunt,
    session 49). Without one the tensors' is used."""
    if hf.get(key) is None:
        return
    declared = positive_int(hf, key, what)
    if declared != d_state:
        raise CheckpointError(f"{what}: config.json's {key} {declared} with {groups_key} {hf.get(groups_key)} does not "
                              f"fit conv1d's {conv_dim} channels ({d_inner} + 2 x groups x state size gives "
                              f"{d_state})")  # fmt: skip


def time_step_limit(hf: dict[str, Any]) -> tuple[float, float]:
    """HF's `time_step_limit`; transformers 5 writes infinity as {"__float__": "Infinity"}, older ones as Infinity."""
    values = hf.get("time_step_limit", (0.0, float("inf")))
    try:  # a number or a pair of strings had escaped as a TypeError / ValueError (loading hunt, session 49)
        lo, hi = (float(v["__float__"] if isinstance(v, dict) else v) for v in values)
    except (TypeError, ValueError, KeyError):
        raise CheckpointError(f"config.json's time_step_limit {values!r:.60} is not a pair of numbers") from None
    return lo, hi


def mamba2_state_spec(cfg: Mamba2Config) -> StateSpec:
    return StateSpec(FAMILY, tuple(t for i in range(cfg.n_layer) for t in mixer_state(cfg, i)))


def mixer_state(cfg: Mamba2Config, i: int) -> list[TensorSpec]:
    """Mamba2 layer i's state: the causal conv's last inputs and the SSM state (this family and hybrids)."""
    return [
        TensorSpec(f"layers.{i}.conv", (cfg.conv_dim, cfg.d_conv - 1), kind="conv"),
        TensorSpec(f"layers.{i}.ssm", (cfg.n_heads, cfg.head_dim, cfg.d_state), kind="recurrent"),
    ]


def global_keys(cfg: Mamba2Config) -> tuple[str, ...]:
    return (EMBEDDING, NORM_F) if cfg.tie_embeddings else (EMBEDDING, NORM_F, HEAD)


def prepare_layer(
    raw: RawTensors, i: int, cfg: Mamba2Config, dtype: torch.dtype, device: torch.device | str, pack: bool = True
) -> Tensors:
    """Layer i in compute form: in_proj/out_proj in `dtype` (prepacked when `pack`), the rest fp32; the conv
    weight as [conv_dim, K], A = -exp(A_log) and a zero conv bias where the checkpoint has none."""
    p = f"{PREFIX}{i}."
    require(raw, [p + "norm.weight"], "Mamba2")
    t = mixer_tensors(raw, p + "mixer.", cfg, dtype, device)
    t["norm.weight"] = raw[p + "norm.weight"].to(device=device, dtype=torch.float32)
    return compute_form(t, LINEAR_KEYS, pack)


def mixer_tensors(raw: RawTensors, prefix: str, cfg: Mamba2Config, dtype: torch.dtype,
                  device: torch.device | str) -> Tensors:  # fmt: skip
    """A Mamba2 mixer's raw tensors under `prefix` (e.g. `backbone.layers.3.mixer.`) as `mixer.*` compute tensors,
    unpacked: the projections in `dtype`, the rest fp32 (the Mamba2 family and hybrids with Mamba2 layers)."""
    names = [k.removeprefix("mixer.") for k in LAYER_KEYS if k.startswith("mixer.")]
    require(raw, [prefix + k for k in names], "Mamba2 mixer")
    names += [k.removeprefix("mixer.") for k in OPTIONAL_KEYS if prefix + k.removeprefix("mixer.") in raw]
    t = {f"mixer.{k}": stored(raw[prefix + k].to(device), dtype) if f"mixer.{k}" in LINEAR_KEYS
         else raw[prefix + k].to(device, torch.float32) for k in names}  # fmt: skip
    t["mixer.conv1d.weight"] = t["mixer.conv1d.weight"].reshape(cfg.conv_dim, cfg.d_conv)
    t.setdefault("mixer.conv1d.bias", torch.zeros(cfg.conv_dim, device=device))
    t["mixer.A"] = -torch.exp(t.pop("mixer.A_log"))
    return t


def prepare_globals(raw: RawTensors, cfg: Mamba2Config, dtype: torch.dtype, device: torch.device | str) -> Tensors:
    """Embedding and head in `dtype` (a tied head is the embedding, prepacked), the final norm fp32."""
    require(raw, global_keys(cfg), "Mamba2")
    emb, head = embedding_and_head(raw, EMBEDDING, HEAD, cfg.tie_embeddings, dtype, device)
    return resident({EMBEDDING: emb, NORM_F: raw[NORM_F].to(device=device, dtype=torch.float32), HEAD: head})


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """RMS norm of y * silu(z) over each of `groups` equal slices of the last axis (HF MambaRMSNormGated). On the
    fused row kernel (`fused.rms_norm`): torch's F.rms_norm took ~28 us for one token's [1, 1536] on CPU, ~10% of a
    0.35B Granite 4.0 H int4 decode step (28 Mamba2 layers; AMD EPYC Zen 4, session 66)."""
    h = y * F.silu(z)
    if groups == 1:
        return rms_norm(h, weight, eps)
    g = torch.unflatten(h, -1, (groups, -1))
    return rms_norm(g, weight.new_ones(g.shape[-1]), eps).flatten(-2) * weight


class Mamba2(ModelBase):
    family = FAMILY
    embed_key = EMBEDDING
    config: Mamba2Config

    def __init__(self, cfg: Mamba2Config, weights: WeightProvider, model_fingerprint: str,
                 device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(cfg, mamba2_state_spec(cfg), weights, model_fingerprint, device)
        self.ssd_chunk = DEFAULT_CHUNK
        self.fused_decode = True  # the mixer's one-token step in one kernel call where it runs (tests turn it off)

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        return x + self._mixer(i, w, rms_norm(x, w["norm.weight"], self.config.norm_eps), state)

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(rms_norm(x, g[NORM_F], self.config.norm_eps), g[HEAD])

    row_keys = LINEAR_KEYS

    def steps_kernel(self) -> bool:
        return self.fused_decode and kernel_available()

    def _mixer(self, i: int, w: Tensors, h: torch.Tensor, state: State) -> torch.Tensor:
        T = h.shape[1]
        return mixer(self.config, w, h, state[f"layers.{i}.conv"], state[f"layers.{i}.ssm"], self.ssd_chunk,
                     self.fused_decode, T > 1 and self.rows_alone(T))  # fmt: skip


def mixer(cfg: Mamba2Config, w: Tensors, h: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
          chunk: int, fused: bool = True, steps: bool = False) -> torch.Tensor:  # fmt: skip
    """The Mamba2 mixer on h [b, T, d_model] with `mixer.*` weights, advancing its conv window and SSM state. Its
    middle runs as one kernel call where it can: a one-token step (`fused`: tests turn it off), and T tokens with
    stepping's arithmetic (`steps`: the model's `rows_alone(T)`, where the rest of its layers give each row the bits
    it has alone); other chunks take the chunked SSD form (faster, equal to steps to rounding)."""
    b, T, _ = h.shape
    H, P, G, N = cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_state
    zxbcdt = linear(h, w["mixer.in_proj.weight"])
    if "mixer.in_proj.bias" in w:
        zxbcdt = zxbcdt + w["mixer.in_proj.bias"]
    z, xbc, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, H], dim=-1)
    A, D = w["mixer.A"], w["mixer.D"]
    y = None
    if fused and (T == 1 or steps):
        y = mixer_steps(zxbcdt, conv, w["mixer.conv1d.weight"], w["mixer.conv1d.bias"], ssm,
                         w["mixer.dt_bias"], A, D, G, cfg.dt_min, cfg.dt_max)  # fmt: skip
    if y is None:  # the torch ops (and the kernel's reference in tests)
        xbc = causal_conv_silu(xbc, conv, w["mixer.conv1d.weight"], w["mixer.conv1d.bias"])
        x, B, C = torch.split(xbc, [cfg.d_inner, G * N, G * N], dim=-1)
        dt = F.softplus(dt + w["mixer.dt_bias"])
        if cfg.dt_min > 0.0 or cfg.dt_max is not None:
            dt = dt.clamp(cfg.dt_min, cfg.dt_max)
        if T == 1:
            y = ssd_step(ssm, x.reshape(b, H, P), dt.reshape(b, H), A, B.reshape(b, G, N), C.reshape(b, G, N), D)
        else:
            y = ssd_chunked(ssm, x.reshape(b, T, H, P), dt, A, B.reshape(b, T, G, N), C.reshape(b, T, G, N), D,
                            chunk)  # fmt: skip
    y = gated_rms_norm(y.reshape(b, T, cfg.d_inner), z, w["mixer.norm.weight"], G, cfg.norm_eps)
    out = linear(y, w["mixer.out_proj.weight"])
    return out + w["mixer.out_proj.bias"] if "mixer.out_proj.bias" in w else out
