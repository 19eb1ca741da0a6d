"""The native generator's assembler (agent/recipe/native/assemble.py) on small code files of its own: options
folded (if / elif / conditional expressions / boolean operators / comparisons, getattr / setattr, **{...},
f-strings, constant attributes), roles bound, a class used only as a base merged into its subclass, what nothing
uses dropped, imports merged; the file it writes compiles and pyflakes finds nothing in it. The code files of
the registry's parts (agent/recipe/native/parts/code/) parse."""

from __future__ import annotations

import textwrap

import pytest

from agent.recipe.native.assemble import AssembleError, Expr, assemble
from agent.recipe.native.assemble import CODE_DIR

OPTIONS = {"SINKS", "NAME", "BIAS", "TABLE", "MODE"}

BASE = '''
"""A base: its docstring is not the file's."""
import math

import torch
from torch import nn

from .norms import ModelNorm as Norm

SINKS = False
NAME = "gate"
BIAS = False
MODE = "plain"
# (a, b) pairs
TABLE = ()
LIMIT = 7


class ModelAttn(nn.Module):
    def __init__(self, config, prefix=""):
        super().__init__()
        setattr(self, NAME, nn.Linear(4, 4, bias=BIAS))
        self.prefix = f"{prefix}.{NAME}"
        self.norm = Norm(4)
        self.renormalize = MODE == "renorm"
        if SINKS:
            # one sink per head
            self.sinks = nn.Parameter(torch.zeros(4))
        elif MODE == "renorm":
            self.other = 1
        else:
            self.other = LIMIT
        self.scale = math.sqrt(2) if SINKS and BIAS else 1.0

    def forward(self, x):
        out = getattr(self, NAME)(x)
        for a, b in TABLE:
            out = out + a * b
        if self.renormalize:
            out = out / out.sum()
        return self._call(out, **({"sink": self.sinks} if SINKS else {}))

    def _call(self, x, **kwargs):
        if not SINKS:
            return x
        return x + kwargs["sink"].sum()
        raise RuntimeError("never")

    def _unused(self):
        return math.pi
'''

NORMS = '''
import torch
from torch import nn


class ModelNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return x * self.weight


class ModelPlusOneNorm(ModelNorm):
    """x * (1 + w)."""

    def __init__(self, width, eps=1e-6):
        super().__init__(width, eps)
        self.weight.weight_loader = load_plus_one

    def twice(self, x):
        return super().forward(x) * 2


def load_plus_one(param, weight):
    param.data.copy_(weight + 1)


def never_used():
    return 0
'''

TOP = '''
from torch import nn

from .base import ModelAttn


class ModelForCausalLM(nn.Module):
    """The model."""

    def __init__(self, config):
        super().__init__()
        self.attn = ModelAttn(config, "x")

    def forward(self, x):
        return self.attn(x)
'''


@pytest.fixture
def code_dir(tmp_path):
    for name, text in (("base.py", BASE), ("norms.py", NORMS), ("top.py", TOP)):
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    return tmp_path


def written(code_dir, options, roles=None, **kwargs):
    return assemble(["norms.py", "base.py", "top.py"], options=options, option_names=OPTIONS,
                    roles={"Norm": "ModelPlusOneNorm"} if roles is None else roles, prefix="Tiny", framework_class="TinyForCausalLM",
                    header="# coding=utf-8", docstring="Tiny.", code_dir=code_dir, tables=frozenset({"TABLE"}), **kwargs)


def pyflakes_messages(text: str) -> list[str]:
    from native_files import pyflakes_messages as messages

    return messages(text)


def test_defaults_fold_away_what_the_options_leave_out(code_dir):
    text = written(code_dir, {})
    assert "SINKS" not in text and "sinks" not in text and "sink" not in text      # the option and its code
    assert "self.gate = nn.Linear(4, 4, bias=False)" in text                     # setattr folded, NAME and BIAS
    assert 'self.prefix = f"{prefix}.gate"' in text                              # f-string literal folded
    assert "self.other = LIMIT" in text and "LIMIT = 7" in text                  # a constant that is not an option stays
    assert "self.scale = 1.0" in text                                            # a conditional expression folded
    assert "renormalize" not in text and "out.sum()" not in text                  # a constant attribute propagated
    assert "for a, b in" not in text and "TABLE" not in text                     # a loop over an empty table
    assert "_unused" not in text and "never_used" not in text and "import math" not in text
    assert 'raise RuntimeError("never")' not in text                             # after a return
    assert "def _call(self, x, **kwargs):\n        return x\n" in text
    assert "A base" not in text                                                   # a code file's docstring
    assert text.startswith("# coding=utf-8\n\n\"\"\"Tiny.\"\"\"\n")
    assert pyflakes_messages(text) == []


def test_options_write_the_variant_they_choose(code_dir):
    text = written(code_dir, {"SINKS": True, "NAME": "router", "BIAS": Expr("config.attention_bias"),
                              "TABLE": ((1, 2), (3, 4)), "MODE": "renorm"})
    assert "self.router = nn.Linear(4, 4, bias=config.attention_bias)" in text
    assert "# one sink per head\n        self.sinks = nn.Parameter(torch.zeros(4))" in text
    assert "self.other" not in text                                              # the elif of a taken if
    assert "self.scale = math.sqrt(2) if config.attention_bias else 1.0" in text  # SINKS and BIAS -> BIAS
    assert "return self._call(out, sink=self.sinks)" in text                      # **{"sink": ...}
    assert "TABLE = (\n    (1, 2),\n    (3, 4),\n)" in text and "for a, b in TABLE:" in text
    assert "if True" not in text and "out = out / out.sum()" in text
    assert pyflakes_messages(text) == []
    compile(text, "generated.py", "exec")


def test_roles_bind_the_chosen_class_and_a_base_merges_into_its_only_subclass(code_dir):
    text = written(code_dir, {})
    assert "self.norm = TinyPlusOneNorm(4)" in text
    assert "class TinyNorm" not in text and "class TinyPlusOneNorm(nn.Module):" in text
    merged = text[text.index("class TinyPlusOneNorm"):text.index("def load_plus_one")]
    assert merged.index("super().__init__()") < merged.index("self.weight = nn.Parameter") \
        < merged.index("self.weight.weight_loader = load_plus_one")                 # the base's __init__ inlined
    assert "def forward(self, x):" in merged and "return self.forward(x) * 2" in merged  # super().forward -> self
    assert '"""x * (1 + w)."""' in merged
    plain = written(code_dir, {}, roles={"Norm": "ModelNorm"})
    assert "class TinyNorm(nn.Module)" in plain and "PlusOne" not in plain and "load_plus_one" not in plain


def test_a_role_no_part_fills_is_refused(code_dir):
    with pytest.raises(AssembleError, match="fills no part for Norm"):
        written(code_dir, {}, roles={})


def test_class_names_must_be_identifiers(code_dir):
    with pytest.raises(AssembleError, match="not a capitalised Python identifier"):
        assemble(["top.py"], options={}, option_names=OPTIONS, roles={"Norm": "ModelNorm"}, prefix="Tiny; import os",
                 framework_class="TinyForCausalLM", code_dir=code_dir)


def test_the_parts_code_files_are_plain_python():
    """Each code file parses and compiles as it stands (importable under the stand-in with a checkout on
    sys.path; pyflakes: tests/lint/test_generated_files_pyflakes.py); the assembler only folds and renames it."""
    files = sorted(CODE_DIR.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        compile(path.read_text(), str(path), "exec")


def test_every_registry_part_names_a_code_file_that_exists():
    from agent.recipe.native.parts import PARTS

    for part in PARTS:
        if part.code:
            assert (CODE_DIR / part.code).is_file(), part.name
        assert part.slot and part.name and callable(part.probe)
    assert len({(p.slot, p.name) for p in PARTS}) == len(PARTS)


SHARED = '''
from torch import nn

BIAS = False
MODE = "plain"


class ModelShared(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=BIAS)
'''

SHAPE = '''
from torch import nn

from .shared import BIAS, MODE, ModelShared


class ModelForCausalLM(ModelShared):
    """The model."""

    def __init__(self, config):
        super().__init__(config)
        self.out = nn.Linear(4, 4, bias=BIAS)
        self.scale = 2.0 if MODE == "renorm" else 1.0
'''


@pytest.mark.parametrize("options, bias, scale", [({}, "False", "1.0"),
                                                  ({"BIAS": Expr("config.bias"), "MODE": "renorm"}, "config.bias", "2.0")])
def test_an_option_imported_from_a_sibling_takes_the_one_value_and_its_base_merges(tmp_path, options, bias, scale):
    """The block shapes' way (parts/code/layer.py): a shape imports its options and its base from one sibling; the
    option is the composition's value (else the declaring file's default) in both files, the base merged away."""
    for name, text in (("shared.py", SHARED), ("shape.py", SHAPE)):
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    text = assemble(["shape.py"], options=options, option_names=OPTIONS, roles={}, prefix="Tiny",
                    framework_class="TinyForCausalLM", code_dir=tmp_path)
    assert f"self.proj = nn.Linear(4, 4, bias={bias})" in text and f"self.out = nn.Linear(4, 4, bias={bias})" in text
    assert f"self.scale = {scale}" in text
    assert "ModelShared" not in text and "TinyShared" not in text and "BIAS" not in text and "MODE" not in text
    assert "class TinyForCausalLM(nn.Module):" in text
    assert text.index("super().__init__()") < text.index("self.proj") < text.index("self.out")
    assert pyflakes_messages(text) == []


def test_an_option_a_sibling_does_not_declare_is_refused(tmp_path):
    (tmp_path / "shared.py").write_text("BIAS = False\n")
    (tmp_path / "shape.py").write_text("from .shared import MODE\n\n\nclass ModelForCausalLM:\n    x = MODE\n")
    with pytest.raises(AssembleError, match="shared.py declares no option MODE"):
        assemble(["shape.py"], options={}, option_names=OPTIONS, roles={}, prefix="Tiny",
                 framework_class="TinyForCausalLM", code_dir=tmp_path)
