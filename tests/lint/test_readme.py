"""README.md is a user's guide that cannot go stale: every `migrator` command it shows parses with the real
CLI and names only options that command's `--help` lists; every path and docs/ link it (or a docs/ page) names
exists; the tables docs/ carries of registered things (the stand-in's kernels, the exit codes) are the
registered ones; its picture names every node of the graph. In-process, seconds. The quick start run off an
NPU as a user runs it: tests/e2e/test_readme_quick_start.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest

from agent import errors
from agent.cli import _parser, main
from locations import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# What a path in the text is checked against: this repository's own top-level folders and files (a path
# of upstream's checkout — executor/, models/NAME/, module/ — is not ours to check).
OURS = ("agent", "engine", "npu_standin", "tests", "scripts", "templates", "skills", "demo")
OUR_FILES = ("Makefile", "pyproject.toml", "constraints.txt", "constraints-transformers-5.0.txt")


def _fenced(text: str, shell: bool = False) -> list[str]:
    """The fenced code blocks (`shell`: only those of commands, not a ```text picture or output),
    continuation lines (a trailing backslash) joined."""
    return [body.replace("\\\n", " ") for lang, body in re.findall(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M)
            if not shell or lang.strip() in ("", "bash", "sh", "shell", "console")]


def _spans(text: str) -> list[str]:
    """Inline `code` spans outside the fenced blocks that are a command (`migrator ...`; prose in a span,
    such as a quoted error line, may say "the migrator was")."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    return [span for span in spans if span.startswith("migrator ")]


def _commands(chunks: list[str]) -> list[list[str]]:
    """Every `migrator SUB ...` in the chunks as its argv after `migrator` (one of a `standin -- migrator
    run ...` line too); a shell comment ends a line."""
    found = []
    for chunk in chunks:
        for line in chunk.splitlines():
            if "migrator " not in line:
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                words = line.split()
            for i, word in enumerate(words[:-1]):
                if word.rsplit("/", 1)[-1] == "migrator" and re.fullmatch(r"[a-z][\w-]*", words[i + 1]):
                    found.append(words[i + 1:])
    return found


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _help(command: str) -> str:
    """`migrator COMMAND --help`, as a user gets it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([command, "--help"]) == 0
    return out.getvalue()


def _flags(argv: list[str]) -> list[str]:
    """The options of one command line (up to a `--`: what follows belongs to the command it runs)."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    return [w.split("=", 1)[0] for w in head if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)]


README_TEXT = README.read_text()
README_COMMANDS = _commands(_fenced(README_TEXT, shell=True) + _spans(README_TEXT))


def test_the_readme_is_a_guide_of_bounded_length_and_names_every_command():
    lines = README_TEXT.count("\n")
    assert lines <= 260, f"README.md has {lines} lines: move reference material to docs/"
    assert len(README_COMMANDS) >= 15
    shown = {argv[0] for argv in README_COMMANDS}
    assert shown >= set(_subcommands()), f"README.md shows no use of: {set(_subcommands()) - shown}"


@pytest.mark.parametrize("argv", README_COMMANDS, ids=lambda argv: " ".join(argv)[:80])
def test_every_migrator_command_in_the_readme_parses_and_its_options_are_in_its_help(argv):
    assert argv[0] in _subcommands(), f"README.md: migrator {argv[0]} is not a command"
    if len(argv) == 1:
        return                           # the command named in prose (`migrator rollback`), not a command line
    try:
        _parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"README.md: `migrator {' '.join(argv)}` does not parse (exit {exc.code})")
    text = _help(argv[0])
    for flag in _flags(argv):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
            f"README.md: `migrator {argv[0]}` has no {flag} in its --help"
    # a command line that runs `migrator` under the stand-in: the inner command is checked as its own entry


def test_every_migrator_option_named_in_docs_exists():
    """docs/ may write placeholders (`RECIPE`, `[--json]`): its commands' options are checked, not parsed."""
    commands = _subcommands()
    options = {name: {o for a in p._actions for o in a.option_strings} for name, p in commands.items()}
    found = 0
    for page in PAGES:
        text = page.read_text()
        for chunk in _fenced(text, shell=True) + _spans(text):
            for match in re.finditer(r"(?:^|[\s/])migrator ([a-z][\w-]*)([^\n`#]*)", chunk, re.M):
                command, rest = match.group(1), match.group(2).split(" -- ", 1)[0]
                found += 1
                assert command in commands, f"{page.name}: migrator {command} is not a command"
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
                    assert flag in options[command], f"{page.name}: migrator {command} has no {flag}"
    assert found >= 20


def test_every_cli_argument_has_help_text():
    """What the newcomer found (rollback's recipe, classify's path, demo --device, env --json had none),
    held for every command and argument."""
    missing = [f"migrator {name} {action.dest}" for name, parser in _subcommands().items()
               for action in parser._actions
               if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert not missing, missing


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_link_to_a_page_of_ours_exists_with_its_anchor(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue                     # a web link
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(linked), f"{page.name}: link to {target}: no such heading"


def test_the_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README_TEXT))
    assert linked == {p.name for p in PAGES}, ({p.name for p in PAGES} - linked, linked - {p.name for p in PAGES})


def test_every_docs_page_starts_by_saying_who_it_is_for():
    for page in PAGES:
        paragraphs = page.read_text().split("\n\n")
        assert paragraphs[0].startswith("# "), page.name
        assert paragraphs[1].startswith("For "), f"{page.name}: its first sentence says who it is for"


def _named_paths(text: str) -> set[str]:
    """Paths of this repository named in the text (placeholders such as `agent/X/y.py`, `NAME`, globs and
    brace lists are not files)."""
    found = set()
    pattern = rf"(?<![\w./-])((?:{'|'.join(OURS)})/[\w./<>{{}}*,…-]*|(?:{'|'.join(map(re.escape, OUR_FILES))}))"
    for raw in re.findall(pattern, text):
        path = raw.split("::", 1)[0].rstrip(".,;:)")
        parts = path.rstrip("/").split("/")
        if re.search(r"[<>{}*…]|\.\.\.", path) or any(len(p.split(".")[0]) == 1 or p.isupper() for p in parts):
            continue
        found.add(path)
    return found


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_path_of_this_repository_named_exists(page):
    paths = _named_paths(page.read_text())
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_path_check_sees_files_and_skips_placeholders():
    text = ("`scripts/bench_recipe.py --threads 1`, tests/unit/npu_standin/kernels/test_mla.py::test_x, "
            "`tests/unit/agent/X/test_y.py`, `agent/codemods/commands/test_<command>.py`, `tests/test_*.py`, "
            "executor/scripts/infer.sh, scripts/nonexistent.py.")
    assert _named_paths(text) == {"scripts/bench_recipe.py", "tests/unit/npu_standin/kernels/test_mla.py",
                                  "scripts/nonexistent.py"}


def test_the_standin_kernel_table_is_the_registered_one():
    from npu_standin import kernels

    page = (DOCS / "standin.md").read_text()
    found = re.search(r"<!-- standin-kernels[^>]*-->\n(.*?)\n<!-- /standin-kernels -->", page, re.S)
    assert found, "docs/standin.md lacks the generated kernel table"
    assert found.group(1) == kernels.table_markdown(), \
        "docs/standin.md's kernel table is stale: paste npu_standin.kernels.table_markdown()"
    uncovered = re.search(r"\*\*Not covered\*\*(.*?)Any op\s+without a reference", page, re.S).group(1)
    names = re.findall(r"`(npu_\w+)`", uncovered)
    assert len(names) >= 5
    assert not [n for n in names if kernels.has_reference(n)], "docs/standin.md calls a covered op not covered"


def _exit_codes() -> set[int]:
    return {value for name, value in vars(errors).items() if name.startswith("EXIT_")}


@pytest.mark.parametrize("page", [README, DOCS / "exit-codes.md"], ids=lambda p: p.name)
def test_the_exit_code_tables_name_every_exit_code(page):
    text = page.read_text()
    section = text[text.index("| code | meaning |"):]
    table = section[:section.index("\n\n")]
    listed = {int(code) for row in table.splitlines()[2:] for code in re.findall(r"\d+", row.split("|")[1])}
    assert listed == _exit_codes(), (listed ^ _exit_codes())


def test_the_picture_names_every_node_of_the_graph():
    from agent.workflow.graph import NODES

    picture = next(block for block in _fenced(README_TEXT) if "detect_env" in block and "classify" in block)
    assert not [node for node in NODES if node not in picture]


def test_ci_runs_the_test_command_the_readme_names():
    setup = next(block for block in _fenced(README_TEXT) if block.lstrip().startswith("make demo"))
    assert [line.split()[:2] for line in setup.splitlines()] == [["make", "demo"], ["make", "test"]]
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
