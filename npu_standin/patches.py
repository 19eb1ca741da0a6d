"""The torch attributes the stand-in replaces, in one table.

Every replacement of a torch / torch.Tensor / torch.nn / torch.distributed attribute goes through
`replace`, so `PATCHED` lists them all by construction. Each one may be met inside a region that
torch.compile (dynamo) captures — a model's decode step under npugraph_ex, say — and must trace there
as the real one does (SPEC §8): a replacement is a plain function closing over the real callable, with
no lookup dynamo cannot compare or guard (a dict keyed by a module object was one: "cannot determine the
equality comparison of an object"). dynamo's own tables name the replacements, not the real callables
they close over: compile._trace_replaced_callables gives each real one its name's rule from `PATCHED`.
tests/unit/npu_standin/test_capture.py compiles every entry of `PATCHED`, so a new one is covered
(or the test names it) without a list to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    name: str           # where it is reached: "torch.nn.functional.linear", "torch.Tensor.to"
    real: object        # what was there before
    replacement: object


PATCHED: dict[str, Patch] = {}


def replace(owner, attr: str, make, *, name: str | None = None):
    """Set `owner.attr` to `make(real)` (the real attribute, None where torch has none: Tensor.npu), once
    per process, and record it; returns the replacement. `name` defaults to owner's dotted name + attr."""
    name = name or f"{_dotted(owner)}.{attr}"
    if name in PATCHED:
        return PATCHED[name].replacement
    real = getattr(owner, attr, None)
    replacement = make(real)
    setattr(owner, attr, replacement)
    PATCHED[name] = Patch(name, real, replacement)
    return replacement


_PUBLIC = {"torch.nn.modules.module.Module": "torch.nn.Module"}


def _dotted(owner) -> str:
    if isinstance(owner, type):
        dotted = f"{owner.__module__}.{owner.__qualname__}"
        return _PUBLIC.get(dotted, dotted)
    return owner.__name__
