"""Every native modeling file the tests write (agent.recipe.native.assemble.assemble, which write() and the MoE
block's render go through) is kept, and pyflakes runs on each once the session ends: a generated file with an
unused import, an undefined or a redefined name fails the session, naming the file's class and the messages
(tests/lint/test_generated_files_pyflakes.py checks the checker)."""

from __future__ import annotations

import io

WRITTEN: dict[int, str] = {}


def pyflakes_messages(text: str, name: str = "generated.py") -> list[str]:
    from pyflakes.api import check
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    check(text, name, Reporter(out, err))
    return out.getvalue().splitlines() + err.getvalue().splitlines()


def recording(monkeypatch_module) -> None:
    """Wrap the assembler so that what it returns is kept in WRITTEN."""
    from agent.recipe.native import assemble

    original = assemble.assemble

    def kept(*args, **kwargs):
        text = original(*args, **kwargs)
        WRITTEN.setdefault(hash(text), text)
        return text

    monkeypatch_module.setattr(assemble, "assemble", kept)


def findings() -> list[str]:
    """`class name: message` for each pyflakes message of each file written so far."""
    found = []
    for text in WRITTEN.values():
        title = next((line.split("(")[0] for line in text.splitlines() if line.startswith("class ")
                      and "ForCausalLM" in line), text.splitlines()[0] if text else "(empty)")
        found += [f"{title}: {message}" for message in pyflakes_messages(text)]
    return found
