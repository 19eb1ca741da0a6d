"""agent/codemods/commands/insert_warm_up.py: a warm-up generation inserted before the formal call of a recipe's
infer.py."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.insert_warm_up import InsertWarmUpCommand


class TestInsertWarmUpCommand(CodemodTest):
    TRANSFORM = InsertWarmUpCommand

    def test_noop_with_a_warm_up_or_without_a_generation(self) -> None:
        code = """
            runner.model_generate(prompts, warm_up=True)
            runner.model_generate(prompts)
        """
        self.assertCodemod(code, code)
        self.assertCodemod("print('no generation')\n", "print('no generation')\n")

    def test_warm_up_goes_before_the_formal_call_with_its_comments(self) -> None:
        before = """
            prompts = load()

            # the formal run
            out = runner.model_generate(prompts)
            runner.model_generate(other)
        """
        after = """
            prompts = load()

            # the formal run
            runner.model_generate(prompts, warm_up=True)
            out = runner.model_generate(prompts)
            runner.model_generate(other)
        """
        self.assertCodemod(before, after)
