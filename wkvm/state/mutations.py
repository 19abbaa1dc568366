"""State mutation rules: registered functions that derive a new state, recorded with their parameters.

A rule gets the spec, the source tensors ([1, ...]), the request's params and a loader for other handles,
and returns new tensors. Register your own with `@register_mutation("name")` (with `params=(...)`, the names it
takes: any other is refused, so the recorded params are the ones that ran).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from wkvm.models.spec import State, StateSpec

Loader = Callable[[str], State]
MutationRule = Callable[[StateSpec, State, dict[str, Any], Loader], State]
RULES: dict[str, MutationRule] = {}
PARAMS: dict[str, tuple[str, ...]] = {}  # a rule's params, where it declared them


class MutationError(ValueError):
    def __init__(self, message: str, param: str = "params"):
        super().__init__(message)
        self.param = param  # the request's field at fault


def register_mutation(name: str, params: tuple[str, ...] | None = None) -> Callable[[MutationRule], MutationRule]:
    def deco(fn: MutationRule) -> MutationRule:
        RULES[name] = fn
        if params is not None:
            PARAMS[name] = params
        else:
            PARAMS.pop(name, None)
        return fn

    return deco


def _fraction(params: dict[str, Any], key: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):  # JSON true is not 1, nor "0.5" a number
        raise MutationError(f"params.{key} must be a number in [0, 1], got {value!r}", f"params.{key}")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise MutationError(f"params.{key} must be in [0, 1], got {value}", f"params.{key}")  # named (hunt, session 49)
    return value


@register_mutation("decay", params=("alpha",))
def decay(spec: StateSpec, state: State, params: dict[str, Any], load: Loader) -> State:
    """Scale the recurrent (matrix) memory by alpha: 1 keeps it, 0 forgets it; token shifts are kept."""
    alpha = _fraction(params, "alpha")
    kinds = {t.name: t.kind for t in spec.tensors}
    if "recurrent" not in kinds.values():
        raise MutationError("decay scales a recurrent memory, and this model's state has none (its attention keys "
                            "and values are the context itself): nothing to decay", "rule")  # fmt: skip
    return {k: v * alpha if kinds[k] == "recurrent" else v.clone() for k, v in state.items()}


@register_mutation("interpolate", params=("other", "t"))
def interpolate(spec: StateSpec, state: State, params: dict[str, Any], load: Loader) -> State:
    """(1 - t) * this + t * other, tensor by tensor; both states come from the same model."""
    t = _fraction(params, "t")
    if spec.has_kv:
        raise MutationError("interpolate blends fixed-size states; this model's state holds attention keys and values "
                            "of its own context, which two states cannot be blended into", "rule")  # fmt: skip
    other = params.get("other")
    if not isinstance(other, str):
        raise MutationError("params.other must be the handle of a state of the same model", "params.other")
    other_state = load(other)
    return {k: torch.lerp(v, other_state[k].to(v.device), t) for k, v in state.items()}


def apply_mutation(rule: str, spec: StateSpec, state: State, params: dict[str, Any], load: Loader) -> State:
    if rule not in RULES:
        raise MutationError(f"unknown mutation rule {rule!r}; known: {sorted(RULES)}", "rule")
    takes = PARAMS.get(rule)
    unknown = sorted(k for k in params if k == "rule" or (takes is not None and k not in takes))
    if unknown:  # the params are recorded as the new state's provenance: only those the rule reads
        said = f"it takes {', '.join(takes)}" if takes else "the rule is the request's `rule`"
        raise MutationError(f"params.{unknown[0]} is not a parameter of rule {rule!r} ({said})")
    return RULES[rule](spec, state, params, load)
