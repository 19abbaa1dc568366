"""Grammar-constrained decoding: each constrained request carries a matcher that says which tokens may come next.

Built on llguidance (docs/decisions-structured-output.md: no dependencies, abi3 wheel, ~1 ms to compile a schema,
tens of microseconds per token mask at vocab 65,536 on one CPU core). A `GrammarCompiler` serves one tokenizer: it
describes the vocabulary to llguidance once, on the first constrained request (0.1-0.3 s at 65,536 tokens, so an
engine that never sees one never pays it), and keeps the compiled grammars in an LRU keyed by the grammar text
(built from the schema's compact JSON). A request gets a copy of the compiled matcher (`GrammarState`): its parse
state lives in the request's sampler row, so it survives preemption, parking and resume with the rest of the row.

The vocabulary llguidance sees is exactly `Tokenizer.token_bytes`, with every special and end token marked special,
so that no grammar takes one for its text: the engine ends a reply on any of the model's end tokens (SmolLM2's
`<|endoftext|>` beside `<|im_end|>`), and a reply leaves special tokens' text out, so a grammar that had taken
`<|endoftext|>` for text inside a JSON string ended the reply there with finish_reason "stop", or lost the text. The
main EOS is allowed only where the grammar's value is complete. Logits wider than the tokenizer (pad rows) are always
masked out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import numpy as np
import torch

from wkvm.models.family import first_line  # llguidance dumps its parser state (~800 characters) after its reason
from wkvm.tokenizer import Tokenizer

SPECIAL_PREFIX = b"\xff"  # llguidance's mark for a special token: never matched as text


class _VocabForLLG:
    """What llguidance's TokenizerWrapper reads: every token's bytes, EOS, and an encoder for forced text."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], eos: int, encode: Callable[[str], list[int]] | None = None):
        self.tokens = tokens
        self.eos_token_id = eos
        self.special_token_ids = [eos]
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance then hands us valid UTF-8 text and tokenizes the rest itself
        return list(self._encode(text)) if self._encode is not None else []


def llg_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it. A tokenizer without EOS gets one extra virtual EOS id (never allowed)."""
    n = tokenizer.vocab_size
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None and tokenizer.eos_token_id < n else n
    tokens = [tokenizer.token_bytes(i) if i < n else b"" for i in range(max(n, eos + 1))]
    for i in {eos, *tokenizer.eos_token_ids, *tokenizer.special_ids}:
        if i < len(tokens):
            tokens[i] = SPECIAL_PREFIX + (tokens[i] or b"<special>")
    # llguidance re-tokenizes forced text; its greedy tokenizer over these exact bytes always agrees with the mask
    bootstrap = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_VocabForLLG(tokens, eos)), n_vocab=len(tokens))
    vocab = _VocabForLLG(tokens, eos, bootstrap.greedy_tokenize)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=len(tokens))


class GrammarState:
    """One request's position in its grammar: the tokens allowed next, and whether the value is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self, width: int) -> torch.Tensor:
        """Bool [width]: tokens the grammar allows next (EOS only once it accepts; pad rows never)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.zeros(width, dtype=np.bool_)
        n = min(width, self._vocab_size)
        mask[:n] = np.unpackbits(bits, bitorder="little")[:n]
        return torch.from_numpy(mask)

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The value is complete: the grammar allows nothing more (the reply ends with finish_reason "stop")."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GrammarCompiler:
    """Compiled grammars for one tokenizer, each compiled once (LRU of `cache_size`), copied per request."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 64):
        self._tokenizer = tokenizer
        self._llg: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.cache_size = cache_size
        self.compilations = 0
        self._lock = threading.Lock()

    def state(self, grammar: str) -> GrammarState:
        """A fresh parse of `grammar` (llguidance grammar text, see `SamplingParams.grammar`)."""
        with self._lock:  # the engine's thread, and request threads checking a grammar at admission
            compiled = self._compiled.get(grammar)
            if compiled is None:
                if self._llg is None:
                    self._llg = llg_tokenizer(self._tokenizer)
                compiled = llguidance.LLMatcher(self._llg, grammar, log_level=0)
                if compiled.is_error():
                    raise ValueError(f"the grammar did not compile: {first_line(compiled.get_error())}")
                self.compilations += 1
                self._compiled[grammar] = compiled
                if len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return GrammarState(compiled.deep_copy(), self._tokenizer.vocab_size)

    def problem(self, grammar: str) -> str | None:
        """Why `grammar` cannot start a reply with this vocabulary (it does not compile, llguidance gives up computing
        its first mask, or the mask is empty), or None. Checked at admission, so such a request is a 400 on its field
        rather than a failure at its first token (a 200 and an error event when streamed: hunt 15); the compiled
        grammar stays cached for the engine. A grammar llguidance gives up on later (`(a|aa){99999}` after one token
        with a small vocabulary: the copies of a compiled grammar share its lexer's budget) still fails in the step."""
        try:
            first = self.state(grammar)
        except ValueError as e:
            return str(e)
        allowed = first.allowed(self._tokenizer.vocab_size)  # computing the mask is where llguidance may give up
        if first.error is not None:
            return first_line(first.error)
        return None if bool(allowed.any()) else "it allows no first token"
