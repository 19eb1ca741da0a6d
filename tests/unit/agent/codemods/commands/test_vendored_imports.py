"""agent/codemods/commands/vendored_imports.py: imports of another model's transformers module pointed at its
vendored copy."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.vendored_imports import VendoredImportsCommand


VENDORED = {"transformers.models.llama.configuration_llama": "models.configuration_llama",
            "transformers.models.llama.modeling_llama": "models.modeling_exaone"}


class TestVendoredImportsCommand(CodemodTest):
    TRANSFORM = VendoredImportsCommand

    def test_noop_other_imports(self) -> None:
        source = """
            from transformers.models.auto import AutoConfig
            from transformers.models.mistral.configuration_mistral import MistralConfig
            from models.configuration_llama import LlamaConfig
            from ...utils import logging
            import transformers.models.llama.configuration_llama
        """
        self.assertCodemod(source, source, vendored=VENDORED)

    def test_module_level_import_points_at_copy(self) -> None:
        # exaone's causal-LM class is llama's: its modeling imports llama's configuration.
        before = """
            from transformers.models.llama.configuration_llama import LlamaConfig as Base, LlamaConfig  # why
        """
        after = """
            from models.configuration_llama import LlamaConfig as Base, LlamaConfig  # why
        """
        self.assertCodemod(before, after, vendored=VENDORED)

    def test_imports_in_functions_and_type_checking_blocks(self) -> None:
        before = """
            if TYPE_CHECKING:
                from transformers.models.llama.modeling_llama import LlamaModel
            def build(config):
                from transformers.models.llama.configuration_llama import (
                    LlamaConfig,  # kept
                )
                return LlamaConfig(**config)
        """
        after = """
            if TYPE_CHECKING:
                from models.modeling_exaone import LlamaModel
            def build(config):
                from models.configuration_llama import (
                    LlamaConfig,  # kept
                )
                return LlamaConfig(**config)
        """
        self.assertCodemod(before, after, vendored=VENDORED)
