"""A part of the native generator (one layer kind: the code it contributes, the config keys that code reads, the
probe that recognises it in the transformers model, the kernels it runs), what a probe answers (`Match`), and the
parts chosen for one architecture (`Composition`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# the slots, in the order derive fills them (a later probe may read an earlier slot's match) and the file
# lists them; the role through which the code of other slots uses the slot's class
SLOTS = ("model", "moe", "embedding", "norm", "position", "attention", "linear_attention", "mlp", "block", "head",
         "mtp")
ROLES = {"norm": "Norm", "position": "RotaryEmbedding", "attention": "Attention", "mlp": "MLP",
         "moe": "SparseMoeBlock", "block": "DecoderLayer", "linear_attention": "LinearAttention"}
FILE_ORDER = ("norm", "position", "mlp", "moe", "attention", "linear_attention", "block", "embedding", "head", "model",
              "mtp")
# the order a composition lists its parts and kernels in (the file's docstring, the report)
LIST_ORDER = ("model", "embedding", "norm", "position", "attention", "linear_attention", "mlp", "moe", "block", "head",
              "mtp")


@dataclass(frozen=True)
class Expr:
    """An option the assembler writes into the file as code, e.g. Expr("config.attention_bias")."""
    code: str


@dataclass(frozen=True)
class Match:
    """A part recognised in the architecture: `options` its code's module constants take for it (folded by the
    assembler), `facts` what the probe read (the kernels' text, the self-check's variants)."""
    part: "Part"
    options: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.part.name

    def kernels(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        fused, unfused = self.part.kernels(self) if self.part.kernels else ((), ())
        return tuple(fused), tuple(unfused)


@dataclass(frozen=True)
class Part:
    """One row of the registry. `probe(probe, chosen) -> Match | None`: None when the architecture's layer is
    not this kind; NotNative when it is, but this instance cannot be written. `chosen`: the earlier slots'
    matches. `variants(match, probe)`: (label, config changes) the file must also serve, each held to
    transformers by the self-check."""
    slot: str
    name: str
    code: str | None                     # its file under parts/code/
    provides: str | None                 # the class its code defines for the slot's role
    reads: tuple[str, ...]               # config keys its code reads at run time
    probe: Callable
    kernels: Callable | None = None      # (fused, not fused) descriptions for a Match
    options: tuple[str, ...] = ()        # the module constants of its code it may set
    variants: Callable | None = None


@dataclass(frozen=True)
class Composition:
    """One part per slot for one architecture: the assembler's one input and what the report records."""
    model_type: str
    matches: dict                        # slot -> Match, in SLOTS order
    checked_variants: tuple = ()         # (label, config changes): other checkpoints of the family the file serves

    def __getitem__(self, slot: str) -> Match:
        return self.matches[slot]

    def get(self, slot: str) -> Match | None:
        return self.matches.get(slot)

    def listed(self) -> list:
        """(slot, match) in LIST_ORDER."""
        return [(slot, self.matches[slot]) for slot in LIST_ORDER if slot in self.matches]

    @property
    def parts(self) -> dict:
        """slot -> part name (the report's native_model.parts)."""
        return {slot: match.name for slot, match in self.listed()}

    @property
    def fused(self) -> tuple[str, ...]:
        return tuple(item for _, match in self.listed() for item in match.kernels()[0])

    @property
    def unfused(self) -> tuple[str, ...]:
        return tuple(item for _, match in self.listed() for item in match.kernels()[1])

    @property
    def options(self) -> dict:
        """Every match's options; a tuple-valued option (a table) is the concatenation of theirs."""
        merged: dict = {}
        for match in self.matches.values():
            for key, value in match.options.items():
                if key in merged and isinstance(value, tuple):
                    merged[key] = merged[key] + value
                elif key in merged and merged[key] != value:
                    raise ValueError(f"option {key}: {merged[key]!r} and {value!r} from two parts")
                else:
                    merged[key] = value
        return merged

    @property
    def files(self) -> list[str]:
        order = {slot: i for i, slot in enumerate(FILE_ORDER)}
        return [m.part.code for slot, m in sorted(self.matches.items(), key=lambda item: order[item[0]])
                if m.part.code]

    @property
    def kept(self) -> tuple[str, ...]:
        """The classes of slots other code does not refer to (the MTP draft): the file keeps them."""
        return tuple(m.part.provides for slot, m in self.matches.items() if slot not in ROLES and m.part.provides)

    @property
    def roles(self) -> dict:
        return {ROLES[slot]: m.part.provides for slot, m in self.matches.items() if slot in ROLES and m.part.provides}

    @staticmethod
    def option_names() -> frozenset:
        """Every option of the registry's parts: the module constants the assembler folds."""
        from agent.recipe.native.parts import OPTION_NAMES

        return OPTION_NAMES

    @staticmethod
    def tables() -> frozenset:
        from agent.recipe.native.parts import TABLES

        return TABLES

    def variants(self, probe) -> list[tuple[str, dict]]:
        found = []
        for match in self.matches.values():
            if match.part.variants is not None:
                found += match.part.variants(match, probe)
        return found
