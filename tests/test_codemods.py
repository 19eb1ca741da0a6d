"""Before/after tests of the vendoring codemods (agent/codemods/commands/), the driver, and a run of
agent.migrate.vendor's codemod sequence over real transformers modeling files."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest
from libcst.codemod import CodemodContext, CodemodTest

from agent.codemods.commands.absolute_imports import AbsoluteImportsCommand, RelativeImportError
from agent.codemods.commands.blank_line_whitespace import BlankLineWhitespaceCommand
from agent.codemods.commands.source_header import SourceHeaderCommand
from agent.codemods.commands.prune_unreachable_definitions import PruneUnreachableDefinitionsCommand
from agent.codemods.commands.remove_gradient_checkpointing import RemoveGradientCheckpointingCommand
from agent.codemods.commands.remove_labels_loss import RemoveLabelsLossCommand
from agent.codemods.commands.runner_settings_init import RunnerSettingsInitCommand
from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from agent.codemods.commands.transformers_init_weights import TransformersInitWeightsCommand
from agent.codemods.commands.vendored_imports import VendoredImportsCommand
from agent.codemods.driver import CodemodError, command, name_of, transform
from agent.migrate.vendor import (apply_codemods, find_model_class_imports, transformers_model_imports,
                                  vendoring_commands)

PACKAGE = "transformers.models.llama"
SIBLINGS = {"transformers.models.llama.configuration_llama": "models.configuration_my_model"}

GUARD = '''
try:
    import torch_npu  # noqa: F401  registers the "npu" device with torch
except Exception:  # NPU backend: not installed, or installed without the CANN runtime
    torch_npu = None
'''


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


def test_transformers_model_imports_skips_auto_and_non_model_modules() -> None:
    source = """
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.auto.modeling_auto import AutoModel
from transformers.models.auto import AutoConfig
from transformers.modeling_utils import PreTrainedModel
from models.configuration_x import XConfig
def f():
    from transformers.models.llama.configuration_llama import LlamaConfig, rope_default
    from transformers.models.llama4.modeling_llama4 import *
"""
    assert transformers_model_imports(source) == {
        "transformers.models.llama.configuration_llama": ["LlamaConfig", "rope_default"],
        "transformers.models.llama4.modeling_llama4": [],
    }


class TestTransformersInitWeightsCommand(CodemodTest):
    TRANSFORM = TransformersInitWeightsCommand

    def test_noop_without_transformers_initialization_or_init_weights(self) -> None:
        remote = """
            import torch

            class RemotePreTrainedModel(PreTrainedModel):
                def _init_weights(self, module):
                    module.weight.data.normal_()
        """
        self.assertCodemod(remote, remote)
        done = """
            from transformers import initialization as init

            class FalconH1MLP(nn.Module):
                def forward(self, x):
                    return x

            class FalconH1PreTrainedModel(PreTrainedModel):
                def _init_weights(self, module):
                    init.ones_(module.D)

                @classmethod
                def is_custom_code(cls):
                    return True
        """
        self.assertCodemod(done, done)

    def test_class_defining_init_weights_is_not_custom_code(self) -> None:
        before = """
            from transformers import initialization as init

            class FalconH1PreTrainedModel(PreTrainedModel):
                config_class = FalconH1Config

                @torch.no_grad()
                def _init_weights(self, module):
                    super()._init_weights(module)
                    if isinstance(module, FalconH1Model):
                        init.copy_(module.layers[0].mamba.mup_vector, compute_mup_vector(module.config))

                def helper(self):
                    pass
        """
        after = """
            from transformers import initialization as init

            class FalconH1PreTrainedModel(PreTrainedModel):
                config_class = FalconH1Config

                @torch.no_grad()
                def _init_weights(self, module):
                    super()._init_weights(module)
                    if isinstance(module, FalconH1Model):
                        init.copy_(module.layers[0].mamba.mup_vector, compute_mup_vector(module.config))

                @classmethod
                def is_custom_code(cls) -> bool:
                    # Vendored transformers code: the loader skips custom code's `_init_weights` on modules without
                    # tensors of their own, which leaves buffers such a module fills uninitialized (falcon_h1's mup_vector).
                    return False

                def helper(self):
                    pass
        """
        self.assertCodemod(before, after)


def test_inserted_is_custom_code_leaves_no_whitespace_only_line() -> None:
    """upstream's trailing-whitespace hook: the blank line before the inserted method has no indentation."""
    source = ("from transformers import initialization as init\n\n\nclass P(PreTrainedModel):\n"
              "    def _init_weights(self, module):\n        init.zeros_(module.weight)\n")
    code = transform(source, [TransformersInitWeightsCommand])
    assert "is_custom_code" in code
    assert not [line for line in code.splitlines() if line != line.rstrip()], code


HEADER = ["coding=utf-8", "Vendored copy.", "Adapted from",
          "https://github.com/huggingface/transformers/blob/v5.0.0/src/transformers/models/gemma2/modeling_gemma2.py",
          "Copyright 2024 Google Inc. HuggingFace Inc. team. All rights reserved.", "",
          'Licensed under the Apache License, Version 2.0 (the "License");',
          "you may not use this file except in compliance with the License."]


class TestSourceHeaderCommand(CodemodTest):
    TRANSFORM = SourceHeaderCommand

    def test_noop_when_the_file_starts_with_the_header(self) -> None:
        code = "".join(f"# {line}\n" if line else "#\n" for line in HEADER) + "import torch\n"
        self.assertCodemod(code, code, header=HEADER)

    def test_banner_goes_and_the_header_names_the_source(self) -> None:
        before = (
            "#                \U0001f6a8\U0001f6a8\U0001f6a8\n"
            "#           This file was automatically generated from src/transformers/models/gemma2/modular_gemma2.py.\n"
            "#               Do NOT edit this file manually as any edits will be overwritten by the generation of\n"
            "#             the file from the modular. If any change should be done, please apply the change to the\n"
            "#                          modular_gemma2.py file directly. One of our CI enforces this.\n"
            "#                \U0001f6a8\U0001f6a8\U0001f6a8\n"
            "# coding=utf-8\n"
            "# Copyright 2024 Google Inc. HuggingFace Inc. team. All rights reserved.\n"
            "#\n"
            "#\n"
            '# Licensed under the Apache License, Version 2.0 (the "License");\n'
            "# you may not use this file except in compliance with the License.\n"
            "# A note on this file.\n"
            "import torch\n")
        after = ("".join(f"# {line}\n" if line else "#\n" for line in HEADER)
                 + "#\n# A note on this file.\nimport torch\n")
        self.assertCodemod(before, after, header=HEADER)
        once = transform(before, [command(SourceHeaderCommand, header=HEADER)])
        assert "automatically generated" not in once and "Do NOT edit" not in once and "\U0001f6a8" not in once
        assert transform(once, [command(SourceHeaderCommand, header=HEADER)]) == once   # idempotent

    def test_a_file_without_any_header_gets_one(self) -> None:
        before = "import torch\n"
        after = "".join(f"# {line}\n" if line else "#\n" for line in HEADER) + "\nimport torch\n"
        self.assertCodemod(before, after, header=HEADER)


class TestBlankLineWhitespaceCommand(CodemodTest):
    TRANSFORM = BlankLineWhitespaceCommand

    def test_noop_on_clean_code(self) -> None:
        code = "class A:\n    x = 1\n\n    def f(self):  # a comment\n        return 1\n"
        assert transform(code, [BlankLineWhitespaceCommand]) == code

    def test_indented_blank_lines_and_line_ends_lose_their_whitespace(self) -> None:
        dirty = "class A:\n    x = 1  \n    \n    def f(self):  # a comment   \n        return 1\n"
        clean = "class A:\n    x = 1\n\n    def f(self):  # a comment\n        return 1\n"
        assert transform(dirty, [BlankLineWhitespaceCommand]) == clean


class TestRunnerSettingsInitCommand(CodemodTest):
    TRANSFORM = RunnerSettingsInitCommand

    def test_noop_layers_and_existing_runner_settings(self) -> None:
        code = """
            class LlamaMLP(nn.Module):
                def __init__(self, config):
                    super().__init__()

            class LlamaAttention(nn.Module):
                def __init__(self, config: LlamaConfig, layer_idx: int):
                    super().__init__()

            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config, runner_settings=None, **kwargs):
                    super().__init__(config)

            class LlamaRotaryEmbedding(nn.Module):
                def __init__(self, config: LlamaConfig, device=None):
                    super().__init__()
        """
        self.assertCodemod(code, code)

    def test_model_class_by_base(self) -> None:
        before = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config: LlamaConfig):
                    super().__init__(config)
        '''
        after = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config: LlamaConfig, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    super().__init__(config)
        '''
        self.assertCodemod(before, after)

    def test_model_class_by_name_and_attribute_base(self) -> None:
        before = '''
            class LlamaForCausalLM(Base, GenerationMixin):
                def __init__(self, config):
                    super().__init__(config)

            class LlamaPreTrainedModel(modeling_utils.PreTrainedModel):
                def __init__(self, config, *inputs):
                    super().__init__(config)
        '''
        after = '''
            class LlamaForCausalLM(Base, GenerationMixin):
                def __init__(self, config, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    super().__init__(config)

            class LlamaPreTrainedModel(modeling_utils.PreTrainedModel):
                def __init__(self, config, *inputs, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    super().__init__(config)
        '''
        self.assertCodemod(before, after)

    def test_existing_params_and_kwargs(self) -> None:
        before = '''
            class AModel(PreTrainedModel):
                def __init__(self, config, add_pooling_layer: bool = True, **kwargs):
                    pass

            class BModel(PreTrainedModel):
                def __init__(self, config, vocab: int = 3):
                    pass
        '''
        after = '''
            class AModel(PreTrainedModel):
                def __init__(self, config, add_pooling_layer: bool = True, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    pass

            class BModel(PreTrainedModel):
                def __init__(self, config, vocab: int = 3, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    pass
        '''
        self.assertCodemod(before, after)

    def test_multiline_signature_keeps_layout(self) -> None:
        before = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(
                    self,
                    config: LlamaConfig,
                ):
                    pass
        '''
        after = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(
                    self,
                    config: LlamaConfig,
                    runner_settings=None,
                    **kwargs,
                ):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    pass
        '''
        self.assertCodemod(before, after)

    def test_nested_classes_untouched(self) -> None:
        before = '''
            class LlamaModel(LlamaPreTrainedModel):
                class InnerModel(PreTrainedModel):
                    def __init__(self, config):
                        pass

                def __init__(self, config):
                    pass

            def factory():
                class LocalModel(PreTrainedModel):
                    def __init__(self, config):
                        pass
                return LocalModel
        '''
        after = '''
            class LlamaModel(LlamaPreTrainedModel):
                class InnerModel(PreTrainedModel):
                    def __init__(self, config):
                        pass

                def __init__(self, config, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    pass

            def factory():
                class LocalModel(PreTrainedModel):
                    def __init__(self, config):
                        pass
                return LocalModel
        '''
        self.assertCodemod(before, after)


    def test_docstring_added_when_missing(self) -> None:
        before = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config):
                    # a comment is not a docstring
                    super().__init__(config)
                    self.x = "text"
        '''
        after = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config, runner_settings=None, **kwargs):
                    r"""
                    runner_settings (`dict`, *optional*):
                        Recipe settings (the YAML) passed by the engine's ModelRunner.
                    """
                    # a comment is not a docstring
                    super().__init__(config)
                    self.x = "text"
        '''
        self.assertCodemod(before, after)

    def test_existing_docstring_left_untouched(self) -> None:
        # Limitation: an existing __init__ docstring is kept as it is and runner_settings is not
        # added to it, so @auto_docstring may still report runner_settings as undocumented.
        before = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config):
                    r"""
                    config (`LlamaConfig`): the configuration.
                    """
                    super().__init__(config)
        '''
        after = '''
            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config, runner_settings=None, **kwargs):
                    r"""
                    config (`LlamaConfig`): the configuration.
                    """
                    super().__init__(config)
        '''
        self.assertCodemod(before, after)


class TestTorchNpuImportGuardEnsured(CodemodTest):
    """The guard as vendoring runs it (ensure=True): a modeling file gets a guarded torch_npu import."""
    TRANSFORM = functools.partial(TorchNpuImportGuardCommand, ensure=True)

    def test_noop_already_guarded(self) -> None:
        code = "import torch\n" + GUARD + "\nx = 1\n"
        self.assertCodemod(code, code)

    def test_other_import_form_is_guarded_not_doubled(self) -> None:
        before = """
            import torch
            import torch_npu as npu
        """
        after = ("import torch\ntry:\n    import torch_npu as npu\nexcept Exception:  # NPU backend: not installed, "
                 "or installed without the CANN runtime\n    npu = None\n")
        self.assertCodemod(before, after)

    def test_after_import_torch(self) -> None:
        before = """
            from collections.abc import Callable

            import torch
            from torch import nn

            from transformers.activations import ACT2FN
        """
        after = (
            "from collections.abc import Callable\n\nimport torch" + GUARD
            + "from torch import nn\n\nfrom transformers.activations import ACT2FN\n"
        )
        self.assertCodemod(before, after)

    def test_after_import_block_without_torch(self) -> None:
        before = '''
            """Configuration."""
            from __future__ import annotations

            import math

            from transformers.configuration_utils import PreTrainedConfig


            class C(PreTrainedConfig):
                pass
        '''
        after = (
            '"""Configuration."""\nfrom __future__ import annotations\n\nimport math\n\n'
            "from transformers.configuration_utils import PreTrainedConfig" + GUARD
            + "\n\nclass C(PreTrainedConfig):\n    pass\n"
        )
        self.assertCodemod(before, after)

    def test_bare_import_becomes_guarded(self) -> None:
        before = """
            import torch

            import torch_npu
            x = 1
        """
        after = ("import torch\n\ntry:\n    import torch_npu\nexcept Exception:  # NPU backend: not installed, "
                 "or installed without the CANN runtime\n    torch_npu = None\nx = 1\n")
        self.assertCodemod(before, after)


class TestRemoveGradientCheckpointingCommand(CodemodTest):
    TRANSFORM = RemoveGradientCheckpointingCommand

    def test_noop_without_checkpointing(self) -> None:
        code = """
            from torch import nn

            class LlamaMLP(nn.Module):
                def forward(self, x):
                    if self.training:
                        x = x * 2
                    return x
        """
        self.assertCodemod(code, code)

    def test_flags_and_class_attribute_removed(self) -> None:
        before = """
            class LlamaPreTrainedModel(PreTrainedModel):
                base_model_prefix = "model"
                supports_gradient_checkpointing = True

            class OnlyFlag(PreTrainedModel):
                supports_gradient_checkpointing = True

            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config):
                    super().__init__(config)
                    self.norm = Norm(config)
                    self.gradient_checkpointing = False

                    # Initialize weights and apply final processing
                    self.post_init()
        """
        after = """
            class LlamaPreTrainedModel(PreTrainedModel):
                base_model_prefix = "model"

            class OnlyFlag(PreTrainedModel):
                pass

            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config):
                    super().__init__(config)
                    self.norm = Norm(config)

                    # Initialize weights and apply final processing
                    self.post_init()
        """
        self.assertCodemod(before, after)

    def test_if_with_else_keeps_else_body(self) -> None:
        before = """
            def run(self, layer, hidden):
                # checkpoint or not
                if self.gradient_checkpointing and self.training:
                    out = self._gradient_checkpointing_func(layer.__call__, hidden)
                else:
                    # plain call
                    out = layer(hidden)
                    out = out + 1
                return out
        """
        after = """
            def run(self, layer, hidden):
                # checkpoint or not
                # plain call
                out = layer(hidden)
                out = out + 1
                return out
        """
        self.assertCodemod(before, after)

    def test_if_without_else_dropped_and_elif_chain(self) -> None:
        before = """
            def run(self, use_cache, x):
                if self.gradient_checkpointing and self.training:
                    use_cache = False
                if x:
                    x = 1
                elif self.gradient_checkpointing:
                    x = 2
                else:
                    x = 3
                if self.training and self.gradient_checkpointing:
                    return None
                if self.training and self.text_model.gradient_checkpointing and x:
                    x = 4
                return x
        """
        after = """
            def run(self, use_cache, x):
                if x:
                    x = 1
                else:
                    x = 3
                return x
        """
        self.assertCodemod(before, after)

    def test_only_statement_becomes_pass_and_ifexp(self) -> None:
        before = """
            def run(self, cache):
                if self.gradient_checkpointing:
                    cache = None
                return layer(cache if not (self.gradient_checkpointing and self.training) else None)
        """
        after = """
            def run(self, cache):
                return layer(cache)
        """
        self.assertCodemod(before, after)

    def test_base_class_and_import_in_list(self) -> None:
        before = """
            import torch
            from torch import nn

            from transformers.modeling_layers import (
                GenericForQuestionAnswering,
                GradientCheckpointingLayer,
            )


            class LlamaDecoderLayer(GradientCheckpointingLayer):
                pass
        """
        after = """
            import torch
            from torch import nn

            from transformers.modeling_layers import (
                GenericForQuestionAnswering,
            )


            class LlamaDecoderLayer(nn.Module):
                pass
        """
        self.assertCodemod(before, after)

    def test_base_class_whole_import_removed_without_nn(self) -> None:
        before = """
            import torch

            from ...modeling_layers import GradientCheckpointingLayer
            from ...modeling_outputs import BaseModelOutputWithPast


            class GPTNeoXLayer(GradientCheckpointingLayer):
                pass
        """
        after = """
            import torch

            from ...modeling_outputs import BaseModelOutputWithPast


            class GPTNeoXLayer(torch.nn.Module):
                pass
        """
        self.assertCodemod(before, after)

    def test_unknown_condition_left_with_warning(self) -> None:
        code = """
            def run(self, x):
                if self.gradient_checkpointing or x:
                    x = 1
                return x
        """
        self.assertCodemod(
            code, code, expected_warnings=["1 reference(s) to gradient_checkpointing left in place"]
        )

    def test_import_kept_while_still_used(self) -> None:
        before = """
            import torch.nn as nn
            from transformers.modeling_layers import GradientCheckpointingLayer

            class Layer(GradientCheckpointingLayer):
                pass

            CHECK = isinstance(Layer(), GradientCheckpointingLayer)
        """
        after = """
            import torch.nn as nn
            from transformers.modeling_layers import GradientCheckpointingLayer

            class Layer(nn.Module):
                pass

            CHECK = isinstance(Layer(), GradientCheckpointingLayer)
        """
        self.assertCodemod(before, after)


class TestRemoveLabelsLossCommand(CodemodTest):
    TRANSFORM = RemoveLabelsLossCommand

    def test_noop_forward_without_labels(self) -> None:
        code = """
            class LlamaForQuestionAnswering(LlamaPreTrainedModel):
                def forward(self, input_ids, start_positions=None, end_positions=None):
                    loss = None
                    if start_positions is not None and end_positions is not None:
                        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
                    return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits)

            def forward(x, labels=None):
                loss = None
                return Output(loss=loss)
        """
        self.assertCodemod(code, code)

    def test_causal_lm_forward(self) -> None:
        before = '''
            class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
                def forward(
                    self,
                    input_ids: torch.LongTensor | None = None,
                    labels: torch.LongTensor | None = None,
                    **kwargs: Unpack[TransformersKwargs],
                ) -> CausalLMOutputWithPast:
                    r"""
                    labels (`torch.LongTensor`, *optional*):
                        Labels for computing the loss.
                    """
                    outputs = self.model(input_ids=input_ids, **kwargs)
                    logits = self.lm_head(outputs.last_hidden_state)

                    loss = None
                    if labels is not None:
                        loss = self.loss_function(logits=logits, labels=labels, **kwargs)

                    return CausalLMOutputWithPast(
                        loss=loss,
                        logits=logits,
                    )
        '''
        after = '''
            class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
                def forward(
                    self,
                    input_ids: torch.LongTensor | None = None,
                    **kwargs: Unpack[TransformersKwargs],
                ) -> CausalLMOutputWithPast:
                    r"""
                    labels (`torch.LongTensor`, *optional*):
                        Labels for computing the loss.
                    """
                    outputs = self.model(input_ids=input_ids, **kwargs)
                    logits = self.lm_head(outputs.last_hidden_state)

                    return CausalLMOutputWithPast(
                        logits=logits,
                    )
        '''
        self.assertCodemod(before, after)

    def test_nested_labels_block_and_tuple_return(self) -> None:
        before = """
            class MoeForCausalLM(MoePreTrainedModel):
                def forward(self, input_ids, labels=None, output_router_logits=None, return_dict=True):
                    loss = None
                    if labels is not None:
                        loss = self.loss_function(logits, labels)
                    aux_loss = None
                    if output_router_logits:
                        aux_loss = load_balancing_loss_func(router_logits)
                        if labels is not None:
                            loss += aux_loss  # add the aux loss
                    if not return_dict:
                        output = (logits,)
                        return (loss,) + output if loss is not None else output
                    return Output(aux_loss=aux_loss, logits=logits, loss=loss)
        """
        after = """
            class MoeForCausalLM(MoePreTrainedModel):
                def forward(self, input_ids, output_router_logits=None, return_dict=True):
                    aux_loss = None
                    if output_router_logits:
                        aux_loss = load_balancing_loss_func(router_logits)
                    if not return_dict:
                        output = (logits,)
                        return output
                    return Output(aux_loss=aux_loss, logits=logits)
        """
        self.assertCodemod(before, after)

    def test_labels_passed_positionally_becomes_none(self) -> None:
        # XLMWithLMHeadModel: `self.pred_layer(hidden_states, labels)` (without the rewrite: NameError on xlm).
        before = """
            class XLMWithLMHeadModel(XLMPreTrainedModel):
                def forward(self, input_ids, labels=None):
                    outputs = self.pred_layer(hidden_states, labels)
                    return head(outputs, target=labels, *rest)
        """
        after = """
            class XLMWithLMHeadModel(XLMPreTrainedModel):
                def forward(self, input_ids):
                    outputs = self.pred_layer(hidden_states, None)
                    return head(outputs, target=None, *rest)
        """
        self.assertCodemod(before, after)

    def test_unknown_labels_use_left_with_warning(self) -> None:
        before = """
            class LlamaForCausalLM(LlamaPreTrainedModel):
                def forward(self, input_ids, labels=None):
                    return self.model(input_ids, *labels.shape)
        """
        after = """
            class LlamaForCausalLM(LlamaPreTrainedModel):
                def forward(self, input_ids):
                    return self.model(input_ids, *labels.shape)
        """
        self.assertCodemod(
            before, after, expected_warnings=["forward: `labels` still used after removing the parameter"]
        )

    def test_labels_last_param_and_passthrough(self) -> None:
        before = """
            class T5Model(T5PreTrainedModel):
                def forward(self, input_ids, labels=None):
                    return self.inner(input_ids, labels=labels)

            class BertModel(BertPreTrainedModel):
                def forward(
                    self,
                    input_ids,
                    *,
                    labels=None,
                ):
                    return input_ids
        """
        after = """
            class T5Model(T5PreTrainedModel):
                def forward(self, input_ids):
                    return self.inner(input_ids)

            class BertModel(BertPreTrainedModel):
                def forward(
                    self,
                    input_ids,
                ):
                    return input_ids
        """
        self.assertCodemod(before, after)


class TestPruneUnreachableDefinitionsCommand(CodemodTest):
    TRANSFORM = PruneUnreachableDefinitionsCommand

    def test_noop_everything_reachable(self) -> None:
        code = """
            import math
            from typing import Optional  # unused from the start: left alone

            from torch import nn

            logger = make_logger()


            def make_logger():
                return None


            class Layer(nn.Module):
                pass


            class Model(nn.Module):
                def __init__(self):
                    self.layer = Layer()
                    self.scale = math.pi


            __all__ = ["Model"]
        """
        self.assertCodemod(code, code, roots=["Model"])

    def test_prunes_definitions_all_and_imports(self) -> None:
        before = """
            from __future__ import annotations

            import json
            import math
            from typing import Optional

            from torch import nn
            from helpers import used_by_head, used_by_extra as extra_alias, kept_helper

            try:
                from fast import fused_kernel, layer_norm
            except ImportError:
                layer_norm = None

            logger = make_logger()


            def make_logger():
                return None


            def default_scale():
                return 1.0


            def unused_helper(x):
                return extra_alias(x)


            class Config:
                pass


            class Layer(nn.Module):
                def __init__(self, config: Config, scale=default_scale()):
                    self.f = kept_helper
                    self.norm = layer_norm


            def decorate(cls):
                return cls


            @decorate
            class Head(Layer):
                _no_split_modules = ["Extra"]  # a string keeps nothing alive

                def forward(self, x) -> "Extra":
                    return used_by_head(x) * math.pi


            # the multimodal part
            class Extra(Head):
                def forward(self, x):
                    return fused_kernel(unused_helper(json.dumps(x)))


            __all__ = ["Head", "Extra", "Layer"]
        """
        after = """
            from __future__ import annotations

            import json
            import math
            from typing import Optional

            from torch import nn
            from helpers import used_by_head, kept_helper

            try:
                from fast import layer_norm
            except ImportError:
                layer_norm = None

            logger = make_logger()


            def make_logger():
                return None


            def default_scale():
                return 1.0


            class Config:
                pass


            class Layer(nn.Module):
                def __init__(self, config: Config, scale=default_scale()):
                    self.f = kept_helper
                    self.norm = layer_norm


            def decorate(cls):
                return cls


            @decorate
            class Head(Layer):
                _no_split_modules = ["Extra"]  # a string keeps nothing alive

                def forward(self, x) -> "Extra":
                    return used_by_head(x) * math.pi


            __all__ = ["Head", "Layer"]
        """
        self.assertCodemod(before, after, roots=["Head"])

    def test_whole_import_line_dropped_and_tuple_all(self) -> None:
        before = """
            import torch_npu
            from torch_npu import npu_kernel
            from transformers.models.auto import AutoModel
            from x import A as B

            class A:
                pass

            class Multi:
                model = AutoModel
                k = npu_kernel
                b = B

            __all__ = ("A", "Multi")
        """
        after = """
            import torch_npu
            from torch_npu import npu_kernel

            class A:
                pass

            __all__ = ("A",)
        """
        self.assertCodemod(before, after, roots=["A"])

    def test_unknown_root_raises(self) -> None:
        with self.assertRaises(ValueError) as caught:
            self.assertCodemod("class A:\n    pass\n", "", roots=["Typo"])
        self.assertIn("Typo", str(caught.exception))


def test_vendoring_sequence() -> None:
    names = [name_of(c) for c in vendoring_commands(PACKAGE, SIBLINGS, runs_model=True)]
    assert names == [
        "AbsoluteImportsCommand",
        "RunnerSettingsInitCommand",
        "TorchNpuImportGuardCommand",
        "RemoveGradientCheckpointingCommand",
        "RemoveLabelsLossCommand",
        "TransformersInitWeightsCommand",
    ]
    assert "TorchNpuImportGuardCommand" not in [name_of(c) for c in vendoring_commands(PACKAGE, SIBLINGS, False)]
    assert all(c.DESCRIPTION and "\n" not in c.DESCRIPTION
               for c in [RunnerSettingsInitCommand, AbsoluteImportsCommand, TorchNpuImportGuardCommand,
                         RemoveGradientCheckpointingCommand, RemoveLabelsLossCommand, TransformersInitWeightsCommand,
                         PruneUnreachableDefinitionsCommand, VendoredImportsCommand])


def test_apply_codemods_reports_changed_codemods() -> None:
    code, applied = apply_codemods("from .configuration_llama import LlamaConfig\n", PACKAGE, SIBLINGS)
    assert code.startswith("from models.configuration_my_model import LlamaConfig\n")
    assert applied == ["AbsoluteImportsCommand", "TorchNpuImportGuardCommand"]
    _, applied = apply_codemods("from .configuration_llama import LlamaConfig\n", PACKAGE, SIBLINGS, runs_model=False)
    assert applied == ["AbsoluteImportsCommand"]


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


def test_find_model_class_imports_flags_models_and_configs_only() -> None:
    source = """
from transformers.models.llama.modeling_llama import LlamaModel, rotate_half
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.auto import AutoModel, AutoConfig
from transformers.modeling_utils import PreTrainedModel
from transformers.configuration_utils import PreTrainedConfig
def f():
    from transformers.models.mistral.configuration_mistral import MistralConfig
"""
    # A configuration class of another model is its implementation too (exaone -> llama's
    # config slipped through); AutoConfig is the registry, not a configuration class.
    assert find_model_class_imports(source) == [
        "transformers.models.llama.modeling_llama.LlamaModel",
        "transformers.models.llama.configuration_llama.LlamaConfig",
        "transformers.models.auto.AutoModel",
        "transformers.models.mistral.configuration_mistral.MistralConfig",
    ]
    assert find_model_class_imports("from transformers.models.auto import AutoConfig\n") == []


# ----------------------------------------------------------------------------------------
# Real modeling files
# ----------------------------------------------------------------------------------------

MODEL_TYPES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt_neox", "olmo2",
               "qwen2_moe", "mixtral", "deepseek_v3"]


def _modeling_file(model_type: str) -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models" / model_type / f"modeling_{model_type}.py"


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_real_modeling_file(model_type: str) -> None:
    path = _modeling_file(model_type)
    if not path.exists():
        pytest.skip(f"{path.name} not in this transformers version")
    package = f"transformers.models.{model_type}"
    config_module = f"{package}.configuration_{model_type}"
    source = path.read_text()
    code, applied = apply_codemods(source, package, {config_module: "models.configuration_my_model"})

    # Most models' PreTrainedModel keeps transformers' default _init_weights: nothing to declare.
    defines_init = "def _init_weights" in source
    assert applied == [name_of(c) for c in vendoring_commands(package, {}, True)
                       if c is not TransformersInitWeightsCommand or defines_init]
    assert ("def is_custom_code" in code) is defines_init
    tree = ast.parse(code)
    compile(code, str(path), "exec")
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative
    assert "from models.configuration_my_model import" in code
    assert "gradient_checkpointing" not in code
    assert "GradientCheckpointingLayer" not in code
    assert GUARD.strip() in code

    causal_lm = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("ForCausalLM"))
    init_args = _method(causal_lm, "__init__").args
    names = [a.arg for a in init_args.args]
    assert "runner_settings" in names
    assert ast.unparse(init_args.defaults[names.index("runner_settings") - len(names)]) == "None"
    assert init_args.kwarg is not None and init_args.kwarg.arg == "kwargs"

    forward = _method(causal_lm, "forward")
    params = [a.arg for a in forward.args.args + forward.args.kwonlyargs]
    assert "labels" not in params
    body_names = {n.id for stmt in forward.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    assert not body_names & {"labels", "loss"}

    assert find_model_class_imports(code) == []


def _prune(code: str, roots: list[str]) -> str:
    command = PruneUnreachableDefinitionsCommand(CodemodContext(), roots=roots)
    return command.transform_module(cst.parse_module(code)).code


def _siblings(model_type: str, name: str) -> dict[str, str]:
    package = f"transformers.models.{model_type}"
    return {
        f"{package}.configuration_{model_type}": f"models.configuration_{name}",
        f"{package}.modeling_{model_type}": f"models.modeling_{name}",
    }


@functools.lru_cache
def _vendored(model_type: str, kind: str, name: str, root: str | None = None) -> str:
    """`{kind}_{model_type}.py` codemodded (configuration files without the torch_npu guard) and,
    given a root, pruned to what it uses. Cached: the pruned gemma3 file serves two tests."""
    source = _modeling_file(model_type).with_name(f"{kind}_{model_type}.py").read_text()
    code, _ = apply_codemods(source, f"transformers.models.{model_type}", _siblings(model_type, name),
                             runs_model=kind != "configuration")
    return _prune(code, [root]) if root else code


def _class_names(code: str) -> set[str]:
    return {n.name for n in ast.parse(code).body if isinstance(n, ast.ClassDef)}


@pytest.mark.parametrize(
    ("model_type", "root", "kept", "removed"),
    [
        ("gemma3", "Gemma3ForCausalLM", ["Gemma3TextModel", "Gemma3DecoderLayer"],
         ["Gemma3ForConditionalGeneration", "Gemma3Model", "Gemma3TextForSequenceClassification"]),
        ("llama", "LlamaForCausalLM", ["LlamaModel", "LlamaPreTrainedModel"],
         ["LlamaForSequenceClassification", "LlamaForQuestionAnswering"]),
    ],
)
def test_prune_real_modeling_file(model_type: str, root: str, kept: list[str], removed: list[str]) -> None:
    path = _modeling_file(model_type)
    if not path.exists():
        pytest.skip(f"{path.name} not in this transformers version")
    pruned = _vendored(model_type, "modeling", "x", root)

    compile(pruned, str(path), "exec")
    assert find_model_class_imports(pruned) == []  # gemma3: `AutoModel` went with the multimodal classes
    classes = _class_names(pruned)
    assert {root, *kept} <= classes
    assert not classes & set(removed)
    exported = next(
        n for n in ast.parse(pruned).body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"
    )
    assert set(ast.literal_eval(exported.value)) <= classes


# Smoke checks run on a recipe dir; one subprocess runs them all, since importing torch and
# transformers there is most of the time. Each prints "<name>-OK" when it passes.
SMOKES = {
    "llama": """
import torch
from transformers.models.llama.modeling_llama import LlamaForCausalLM as Original
from models.configuration_my_model import LlamaConfig
from models.modeling_my_model import LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
vendored = LlamaForCausalLM(config, runner_settings={"device": "cpu"}).eval()
original = Original(config).eval()
original.load_state_dict(vendored.state_dict())
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    assert torch.equal(vendored(ids).logits, original(ids).logits)
    out = vendored.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, original.generate(ids, max_new_tokens=3, do_sample=False))
""",
    "gemma3": """
import os

import torch
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

from models.configuration_x import Gemma3TextConfig
from models.modeling_x import Gemma3ForCausalLM

ckpt = os.environ["GEMMA3_TEXT_CKPT"]
config = Gemma3TextConfig.from_pretrained(ckpt)
for key in (Gemma3ForCausalLM.__name__, config.model_type):  # as the engine does for vendored classes
    mapping = get_checkpoint_conversion_mapping(key)
    if mapping is not None:
        register_checkpoint_conversion_mapping(key, mapping, overwrite=True)
vendored, info = Gemma3ForCausalLM.from_pretrained(ckpt, config=config, output_loading_info=True)
assert not info["missing_keys"] and not info["mismatched_keys"], info
original = AutoModelForCausalLM.from_pretrained(ckpt)
assert type(vendored).__module__ == "models.modeling_x", type(vendored)
assert type(original).__module__.startswith("transformers."), type(original)
ids = torch.tensor([[1, 5, 9, 17, 33, 65, 2]])
with torch.no_grad():
    diff = (vendored.eval()(ids).logits - original.eval()(ids).logits).abs().max().item()
assert diff <= 1e-4, diff
""",
}

RUN_SMOKES = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    name = path.removeprefix("smoke_").removesuffix(".py")
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        print(f"--- {name} failed ---", file=sys.stderr)
        traceback.print_exc()
    else:
        print(f"{name}-OK")
"""


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """A recipe dir with codemodded llama files and pruned gemma3 files, and the smoke checks' run."""
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint("gemma3_text", tmp_path_factory.mktemp("gemma3_text"))
    recipe = tmp_path_factory.mktemp("recipe")
    models = recipe / "models"  # namespace package, as in a recipe
    models.mkdir()
    for kind in ("configuration", "modeling"):
        (models / f"{kind}_my_model.py").write_text(_vendored("llama", kind, "my_model"))
    (models / "configuration_x.py").write_text(_vendored("gemma3", "configuration", "x"))
    (models / "modeling_x.py").write_text(_vendored("gemma3", "modeling", "x", "Gemma3ForCausalLM"))
    for name, script in SMOKES.items():
        (recipe / f"smoke_{name}.py").write_text(script)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(recipe), GEMMA3_TEXT_CKPT=str(ckpt))
    return subprocess.run([sys.executable, "-c", RUN_SMOKES, *(f"smoke_{n}.py" for n in SMOKES)],
                          cwd=recipe, capture_output=True, text=True, env=env, timeout=180)


def test_vendored_llama_matches_transformers(smoke_run: subprocess.CompletedProcess) -> None:
    """The codemodded llama files import from a recipe dir and compute the same logits."""
    assert smoke_run.returncode == 0, smoke_run.stderr[-2000:]
    assert "llama-OK" in smoke_run.stdout, smoke_run.stderr[-3000:]


def test_vendored_pruned_gemma3_text_matches_transformers(smoke_run: subprocess.CompletedProcess) -> None:
    """The pruned gemma3 file (no AutoModel) loads a gemma3_text checkpoint: same logits as transformers."""
    assert smoke_run.returncode == 0, smoke_run.stderr[-2000:]
    assert "gemma3-OK" in smoke_run.stdout, smoke_run.stderr[-3000:]
    # runner_settings is documented, so @auto_docstring prints no "[ERROR] `runner_settings` ..." line.
    assert "runner_settings" not in smoke_run.stdout + smoke_run.stderr
