"""The model families the conformance suite runs (tests/test_conformance.py): one module per family.

Each module (its name is the test id) has `NAME` (the registry's family name) and
`write_checkpoint(path, vocab_size, seed) -> Path`, which
writes a tiny random checkpoint of the family as a directory (config.json + weights, in the family's main format)
with `vocab_size` tokens; `INT8 = False` where the family has no int8 weights (default True). The suite adds a
tokenizer and chat template beside it and runs every state operation.
A family that needs registering first (a test-only one) does so when its module is imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def all_families() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{m.name}") for m in sorted(pkgutil.iter_modules(__path__))]
