"""The suite's own tables hold what they promise: the bad-input table has its 40 rows with distinct ids, every
npu-smi sample under tests/data is checked, every family of the routing table has a case in the default suite,
the field corpus has its 40 sourced modes and an injection for each (one per rule by default). The tables
live with their tests; the test modules are loaded here by path (they never import one another)."""

from __future__ import annotations

import importlib.util
import sys

import yaml

from field_injections import INJECTIONS, cases
from locations import TESTS


def suite_module(rel: str):
    """The test module at tests/REL, loaded under a name of its own."""
    path = TESTS / rel
    name = "suite_table_" + path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module      # dataclasses of the module look themselves up there
        spec.loader.exec_module(module)
    return sys.modules[name]


CASES = suite_module("e2e/test_bad_input.py").CASES
_environment = suite_module("unit/engine/test_environment.py")
NPU_SMI_DATA, NPU_SMI_SAMPLES = _environment.NPU_SMI_DATA, _environment.NPU_SMI_SAMPLES
_families = suite_module("e2e/test_families.py")
FAMILY_CASES, DEFAULT_CASES = _families.FAMILY_CASES, _families.DEFAULT_CASES
CORPUS = yaml.safe_load((TESTS / "field_faults" / "corpus.yaml").read_text())


def test_table_has_at_least_40_rows():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


def test_every_npu_smi_sample_is_checked():
    assert sorted(p.name for p in NPU_SMI_DATA.glob("*.txt")) == sorted(NPU_SMI_SAMPLES)


def test_every_family_has_a_case_in_the_default_suite():
    assert {FAMILY_CASES[m] for m in DEFAULT_CASES} | {"standard"} == set(FAMILY_CASES.values())


def test_corpus_has_40_sourced_modes():
    sourced = [e for e in CORPUS if not e.get("local")]
    assert len({e["id"] for e in CORPUS}) == len(CORPUS)
    assert len(sourced) >= 40
    for entry in sourced:
        assert entry["source"].startswith("https://"), entry["id"]
        assert entry["outcome"] in ("repaired", "reported", "exit4", "unknown"), entry["id"]
        assert entry["outcome"] == "repaired" or entry.get("why"), entry["id"]


def test_every_corpus_entry_has_an_injection():
    assert {i.id for i in INJECTIONS} == {e["id"] for e in CORPUS}
    for injection in INJECTIONS:
        assert injection.kind in ("real", "replayed"), injection.id
        if injection.expected("ours") == "reported":
            assert injection.note, f"{injection.id}: a reported mode names the note it must print"
    # make test: one injection per rule at most, a dozen or so
    fast = [(i, layout) for i, layout in cases() if (i.fast if layout == "ours" else i.fast_upstream)]
    rules = [i.rule(layout) or i.expected(layout) for i, layout in fast]
    assert len(fast) <= 14 and len(rules) == len(set(rules)), rules


def test_every_row_of_the_budget_table_names_a_test_that_exists_and_its_cover_runs_by_default():
    """A row whose test was renamed would move nothing; a row whose cover is itself moved covers nothing."""
    import ast
    import re

    from budget import SLOW_FOR_BUDGET, slow_for_budget

    for nodeid, cover in SLOW_FOR_BUDGET.items():
        rel, _, name = nodeid.partition("::")
        path = TESTS.parent / rel
        assert path.is_file(), nodeid
        functions = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert name.split("[", 1)[0] in functions, nodeid
        for named in re.findall(r"tests/\S+?\.py::\w+", cover):
            assert slow_for_budget(named) is None, f"{nodeid}: its cover {named} is moved to slow as well"
