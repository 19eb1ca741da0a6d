"""agent/codemods/commands/absolute_imports.py: a vendored file's relative imports made absolute, siblings mapped
to the recipe's modules."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.absolute_imports import AbsoluteImportsCommand, RelativeImportError
from codemod_inputs import PACKAGE, SIBLINGS


class TestAbsoluteImportsCommand(CodemodTest):
    TRANSFORM = AbsoluteImportsCommand

    def test_noop_absolute_imports(self) -> None:
        code = """
            import torch
            from torch import nn
            from transformers.activations import ACT2FN
        """
        self.assertCodemod(code, code, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_three_dots_resolve_to_transformers(self) -> None:
        before = """
            from ...activations import ACT2FN
            from ...utils.generic import merge_with_config_defaults as merge
        """
        after = """
            from transformers.activations import ACT2FN
            from transformers.utils.generic import merge_with_config_defaults as merge
        """
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_two_dots_resolve_to_models(self) -> None:
        before = "from ..auto import AutoModel\n"
        after = "from transformers.models.auto import AutoModel\n"
        self.assertCodemod(before, after, package=PACKAGE)

    def test_dots_only(self) -> None:
        before = """
            from ... import initialization as init
            from . import *
        """
        after = """
            from transformers import initialization as init
            from transformers.models.llama import *
        """
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_sibling_module_is_mapped(self) -> None:
        before = "from .configuration_llama import LlamaConfig\n"
        after = "from models.configuration_my_model import LlamaConfig\n"
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_from_dot_import_sibling_keeps_local_name(self) -> None:
        before = """
            from . import configuration_llama
            from . import configuration_llama as cfg
        """
        after = """
            from models import configuration_my_model as configuration_llama
            from models import configuration_my_model as cfg
        """
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_from_dot_import_mixed_is_split(self) -> None:
        before = """
            # config and tokenizer
            from . import configuration_llama, tokenization_llama
        """
        after = """
            # config and tokenizer
            from transformers.models.llama import tokenization_llama
            from models import configuration_my_model as configuration_llama
        """
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_sibling_mapped_to_top_level_module(self) -> None:
        before = "from . import configuration_llama\n"
        after = "import configuration_my_model as configuration_llama\n"
        siblings = {"transformers.models.llama.configuration_llama": "configuration_my_model"}
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=siblings)

    def test_parenthesised_list_and_comments_preserved(self) -> None:
        before = """
            from ...modeling_layers import (  # layers
                GenericForQuestionAnswering,
                # training only
                GradientCheckpointingLayer,
            )
        """
        after = """
            from transformers.modeling_layers import (  # layers
                GenericForQuestionAnswering,
                # training only
                GradientCheckpointingLayer,
            )
        """
        self.assertCodemod(before, after, package=PACKAGE)

    def test_nested_relative_import(self) -> None:
        before = """
            def load():
                if True:
                    from ...integrations.hub_kernels import lazy_load_kernel
                return lazy_load_kernel
        """
        after = """
            def load():
                if True:
                    from transformers.integrations.hub_kernels import lazy_load_kernel
                return lazy_load_kernel
        """
        self.assertCodemod(before, after, package=PACKAGE)

    def test_one_line_suite(self) -> None:
        before = "if TYPE_CHECKING: from .configuration_llama import LlamaConfig; from . import configuration_llama\n"
        after = (
            "if TYPE_CHECKING: from models.configuration_my_model import LlamaConfig; "
            "from models import configuration_my_model as configuration_llama\n"
        )
        self.assertCodemod(before, after, package=PACKAGE, sibling_modules=SIBLINGS)

    def test_too_many_dots_raise(self) -> None:
        with self.assertRaises(RelativeImportError) as caught:
            self.assertCodemod("from .... import x\n", "", package=PACKAGE)
        self.assertIsInstance(caught.exception, ValueError)
        self.assertIn("beyond the top-level package", str(caught.exception))
