"""The reference test of a part of the native generator (agent/recipe/native/parts): each model type that uses it,
derived on its checkpoint-shaped config (agent.testing.checkpoint_shapes), rendered, held to transformers per step
(agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family setting the parts read, and a file with
the part's arithmetic broken (a fault) that must fail the same check — all in one stand-in process.

A new tests/unit/agent/recipe/native/test_part_*.py uses it so:

    from part_selfcheck import derive_types, selfcheck_with_faults

    # type: faults, (text of the correct file, its faulty replacement); each text appears once in the file
    FAULTS = {"olmo2": [("square_sum / self.width", "square_sum / (self.width // 2)")]}

    @pytest.fixture(scope="module")
    def derived():
        return derive_types(FAULTS)           # type -> (config, composition)

    def test_my_part_files_match_transformers_and_faults_fail(derived, tmp_path):
        selfcheck_with_faults(derived, FAULTS, "MyForCausalLM", tmp_path)

It skips without the upstream snapshot (../shared/upstream/cann-recipes-infer), asserts every correct run passes
and every fault fails, and returns the rows ((type, label, expected ok, result)) for checks of their own (a
fault's reason). The rope types' labels are left out by default (test_part_rotary.py holds the rope types);
`keep` chooses the labels otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def not_rope(label: str) -> bool:
    return not label.startswith("rope")


def ctx(model_type: str, framework_class: str) -> dict:
    """The render context of a test's file of `model_type`."""
    return {"model_name": model_type, "framework_class": framework_class, "display_name": model_type,
            "model_class": "X"}


def derive_types(types) -> dict:
    """type -> (its checkpoint-shaped config, its composition) for each type of `types`."""
    from agent.recipe.native.compose import derive
    from agent.testing.checkpoint_shapes import checkpoint_config

    found = {}
    for model_type in types:
        config, _ = checkpoint_config(model_type)
        found[model_type] = (config, derive(config))
    return found


def selfcheck_with_faults(derived: dict, faults: dict, framework_class: str, folder: Path,
                          keep: Callable[[str], bool] = not_rope) -> list[tuple]:
    """Render each type of `derived` (type -> (config, composition)), self-check its file on the labels `keep`
    takes and each of its `faults` (type -> [(correct text, faulty text)]) written into a copy; assert the correct
    runs pass and the faults fail. Returns [(type, label, expected ok, result)]."""
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    jobs, labels = [], []
    for model_type, (config, composition) in derived.items():
        text = render_native(ctx(model_type, framework_class), composition)
        good = folder / f"{model_type}.py"
        good.write_text(text)
        for label, job in selfcheck_jobs(config, composition.checked_variants, str(good), framework_class):
            if keep(label):
                jobs.append(job)
                labels.append((model_type, label, True))
        for index, (correct, faulty) in enumerate(faults.get(model_type, ())):
            assert text.count(correct) == 1, (model_type, correct)
            bad = folder / f"{model_type}_fault{index}.py"
            bad.write_text(text.replace(correct, faulty))
            jobs.append({"config": config, "file": str(bad), "class_name": framework_class})
            labels.append((model_type, f"fault {index}", False))
    results = selfcheck(jobs, SNAPSHOT)
    wrong = [(t, label, r["reason"]) for (t, label, ok), r in zip(labels, results) if r["ok"] != ok]
    assert not wrong, wrong
    return [(t, label, ok, r) for (t, label, ok), r in zip(labels, results)]


def write_with_faults(text: str, table: dict, faults, folder: Path) -> tuple[Path, list[Path]]:
    """`text` written to folder/good.py and, for each name of `faults`, a copy with its `table` entry (correct text,
    faulty replacement; the correct text appears once) swapped in, as folder/<name>.py: (good, [faulty])."""
    folder.mkdir(parents=True, exist_ok=True)
    good = folder / "good.py"
    good.write_text(text)
    bad = []
    for fault in faults:
        old, new = table[fault]
        assert text.count(old) == 1, fault
        path = folder / f"{fault}.py"
        path.write_text(text.replace(old, new))
        bad.append(path)
    return good, bad
