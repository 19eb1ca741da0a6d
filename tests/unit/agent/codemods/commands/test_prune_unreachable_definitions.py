"""agent/codemods/commands/prune_unreachable_definitions.py: definitions the roots cannot reach pruned (on real
transformers modeling files: tests/unit/agent/migrate/test_vendor.py)."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.prune_unreachable_definitions import PruneUnreachableDefinitionsCommand


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
