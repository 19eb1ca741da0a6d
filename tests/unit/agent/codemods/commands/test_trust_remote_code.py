"""agent/codemods/commands/trust_remote_code.py: trust_remote_code=True added to the one from_pretrained call
that needs it."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.trust_remote_code import TrustRemoteCodeCommand


class TestTrustRemoteCodeCommand(CodemodTest):
    TRANSFORM = TrustRemoteCodeCommand

    def test_noop_on_a_line_without_from_pretrained(self) -> None:
        code = """
            config = AutoConfig.from_pretrained(path)
            model = build(config)
        """
        self.assertCodemod(code, code, line=2)

    def test_adds_the_keyword_on_that_line_only(self) -> None:
        before = """
            config = AutoConfig.from_pretrained(path)
            other = AutoConfig.from_pretrained(path)
        """
        after = """
            config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            other = AutoConfig.from_pretrained(path)
        """
        self.assertCodemod(before, after, line=1)

    def test_multiline_call_and_explicit_false(self) -> None:
        before = """
            tok = AutoTokenizer.from_pretrained(
                path,
                use_fast=True,
            )
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        """
        after = """
            tok = AutoTokenizer.from_pretrained(
                path,
                use_fast=True,
                trust_remote_code=True,
            )
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        """
        self.assertCodemod(before, after, line=3)
        self.assertCodemod(
            "cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)\n",
            "cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)\n", line=1)
