"""Every rewrite of Python source the migrator makes, as libcst codemod commands (libcst's
`codemod/commands` layout): one command per file in `commands/`, each a small transform with a
one-line DESCRIPTION and a CodemodTest (tests/unit/agent/codemods/commands/test_<command>.py);
`driver.py` runs a list of them on a source or a recipe file; `_toolkit.py` is what they share.
Who runs which, in what order, is the caller's: agent.migrate.vendor.vendoring_commands, the
repair rules.
"""
