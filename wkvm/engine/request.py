"""A request's lifecycle: waiting -> running (<-> parked) -> finished (stopped / length / aborted / error)."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

import torch

from wkvm.engine.drafts import NgramDrafter
from wkvm.models.spec import State
from wkvm.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class Continuation:
    """A request stopped at a token boundary to go on in another engine (live migration; Engine.suspend/resume).

    `state` holds `base_ids` and the first `num_computed_tokens` of prompt + output; the rest of the output (its last
    token, after a sampled one) is pending. The seeded generator's position, the states the request captured and
    the text already released go with it, so the destination samples, stops and reports exactly as the source
    would have: penalties and the grammar's parse are rebuilt from `output_ids`, the stop-string tail from them too.
    """

    prompt_ids: list[int]
    base_ids: list[int]
    output_ids: list[int]
    num_computed_tokens: int
    state: State
    generator: torch.Tensor | None = None  # torch.Generator.get_state() of a seeded request
    text: str = ""  # the output's text released so far (what the client has been sent)
    capture_state: bool = False
    capture_prompt_state: bool = False
    prompt_state: State | None = None
    capture_at: int | None = None
    branch_state: State | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first; ties go to the earlier arrival
    admitted: float | None = None  # when it first got a slot (monotonic seconds): its time in the queue ends
    deadline: float | None = None  # monotonic seconds
    initial_state: State | None = None  # start from this state instead of zeros (host copy, batch 1)
    base_ids: list[int] = field(default_factory=list)  # tokens already inside initial_state
    capture_state: bool = False  # keep a host copy of the final state in `final_state`
    prefill_only: bool = False  # feed the prompt, sample nothing, finish (to build a state)
    capture_prompt_state: bool = False  # keep a copy of the state after prompt_ids[:-1] in `prompt_state`
    prompt_state: State | None = None
    capture_at: int | None = None  # also keep the state after this many prompt tokens (a branch point) ...
    branch_state: State | None = None  # ... here
    # per prompt token fed so far, with params.prompt_logprobs (the first token's is None): filled by the runner
    prompt_logprobs: list[dict[int, float] | None] | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of prompt + output already fed into the state
    slot: int | None = None
    parked_state: State | None = None  # host copy while preempted
    final_state: State | None = None
    final_ready: threading.Event | None = None  # set once `final_state` is filled, when it is copied out off the step
    error: str | None = None
    error_code: str | None = None  # an ErrorCode value (wkvm.outputs) when it ended in error or abort
    cancel_requested: bool = False
    # speculative decoding (docs/speculative.md): the request's prompt-lookup index (None: it does not speculate), the
    # draft fed after its pending token this step, and, while a checked draft's tokens are in its state, the state's
    # fixed tensors before them (`speculated`: how many tokens had been computed then)
    drafter: NgramDrafter | None = None
    draft_room: int | None = None  # the longest draft it checks next: shorter after refused ones (`Engine._draft`)
    draft: list[int] = field(default_factory=list)
    speculated: int | None = None
    before_draft: State | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def gap(self) -> int:
        """Tokens known but not yet fed into the state."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_ids)

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def next_tokens(self, n: int) -> list[int]:
        """The next n tokens to feed: known ones, then this step's draft."""
        known = min(n, self.num_tokens - self.num_computed_tokens)
        ids = [self.token_at(i) for i in range(self.num_computed_tokens, self.num_computed_tokens + known)]
        return ids + self.draft[: n - known]

    def history_from(self, i: int) -> list[int]:
        """`history()[i:]` without building the whole list."""
        nb, np_ = len(self.base_ids), len(self.prompt_ids)
        if i >= nb + np_:
            return self.output_ids[i - nb - np_ :]
        return (self.base_ids[i:] if i < nb else []) + self.prompt_ids[max(0, i - nb) :] + self.output_ids

    def fed_token_ids(self) -> list[int]:
        """Exactly the tokens whose effect is in the state."""
        return [self.token_at(i) for i in range(self.num_computed_tokens)]

    def history(self) -> list[int]:
        """All tokens of this sequence, base included; the state holds all but the pending (last) one."""
        return self.base_ids + self.prompt_ids + self.output_ids

    def snapshot_history(self) -> list[int]:
        """Tokens matching the current state: those fed, plus the next one as pending."""
        fed = self.base_ids + self.fed_token_ids()
        return fed + [self.token_at(self.num_computed_tokens)] if self.gap > 0 else fed

    def check_invariant(self) -> None:
        assert self.num_computed_tokens <= self.num_tokens, (
            f"request {self.request_id}: computed {self.num_computed_tokens} > known {self.num_tokens}"
        )
