"""agent/codemods/driver.py: a list of codemod commands run in order, what changed named, errors naming the
command."""

from __future__ import annotations

import pytest

from agent.codemods.commands.absolute_imports import AbsoluteImportsCommand
from agent.codemods.commands.runner_settings_init import RunnerSettingsInitCommand
from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from agent.codemods.driver import CodemodError, command, transform
from agent.migrate.vendor import apply_codemods
from codemod_inputs import PACKAGE, SIBLINGS


def test_driver_runs_a_list_in_order_and_names_what_changed() -> None:
    source = "from .configuration_llama import LlamaConfig\n"
    absolute = command(AbsoluteImportsCommand, package=PACKAGE, sibling_modules=SIBLINGS)
    applied: list[str] = []
    assert transform(source, [absolute], applied=applied) == "from models.configuration_my_model import LlamaConfig\n"
    assert applied == ["AbsoluteImportsCommand"]
    applied = []
    code = transform(source, [command(TorchNpuImportGuardCommand, ensure=True), absolute], applied=applied)
    assert applied == ["TorchNpuImportGuardCommand", "AbsoluteImportsCommand"]
    assert code.startswith("from models.configuration_my_model import LlamaConfig\ntry:\n    import torch_npu")
    applied = []
    assert transform(source, [], applied=applied) == source and applied == []


def test_driver_error_names_the_command() -> None:
    with pytest.raises(CodemodError, match="AbsoluteImportsCommand"):
        apply_codemods("from .... import x\n", PACKAGE, SIBLINGS)
    with pytest.raises(CodemodError, match="cannot parse"):
        transform("def f(:\n", [RunnerSettingsInitCommand])
