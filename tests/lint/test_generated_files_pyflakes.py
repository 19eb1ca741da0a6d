"""pyflakes finds nothing in the native files the tests generate: every file the assembler writes during a
test session is kept (tests/support/native_files.py, an autouse session fixture of tests/conftest.py) and
checked when the session ends — so the files of every native type, fault-free, that the native tests derive
are checked where they are made, at no cost of their own. Here: the checker itself (a defect it must name),
the recording, and the code files the parts contribute."""

from __future__ import annotations

import textwrap

import native_files


def test_the_checker_names_what_a_maintainer_would_not_write():
    bad = textwrap.dedent('''
        import math
        from torch import nn


        class TinyForCausalLM(nn.Module):
            def forward(self, x):
                unused = 1
                return x + undefined
    ''')
    messages = native_files.pyflakes_messages(bad)
    assert any("'math' imported but unused" in m for m in messages), messages
    assert any("undefined name 'undefined'" in m for m in messages), messages
    assert any("local variable 'unused' is assigned to but never used" in m for m in messages), messages


def test_what_the_assembler_writes_is_recorded_and_checked(tmp_path):
    from agent.recipe.native import assemble

    (tmp_path / "top.py").write_text(textwrap.dedent('''
        import math

        from torch import nn

        FLAG = False


        class ModelForCausalLM(nn.Module):
            def forward(self, x):
                if FLAG:
                    return math.sqrt(x)
                return x
    ''').lstrip())
    before = len(native_files.WRITTEN)
    text = assemble.assemble(["top.py"], options={}, option_names={"FLAG"}, roles={}, prefix="Lint",
                             framework_class="LintForCausalLM", code_dir=tmp_path)
    assert len(native_files.WRITTEN) == before + 1 and text in native_files.WRITTEN.values()
    assert "import math" not in text and native_files.pyflakes_messages(text) == []


def test_the_parts_code_files_are_pyflakes_clean():
    from agent.recipe.native.assemble import CODE_DIR

    files = sorted(CODE_DIR.glob("*.py"))
    assert len(files) >= 10
    found = {path.name: native_files.pyflakes_messages(path.read_text(), path.name) for path in files}
    assert {name: messages for name, messages in found.items() if messages} == {}
