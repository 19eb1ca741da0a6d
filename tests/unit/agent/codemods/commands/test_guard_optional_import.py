"""agent/codemods/commands/guard_optional_import.py: an import of an optional package (flash_attn) guarded."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.guard_optional_import import GUARD_FLASH_ATTN, GuardOptionalImportCommand


class TestGuardFlashAttnImportCommand(CodemodTest):
    TRANSFORM = GuardOptionalImportCommand

    def test_noop_when_guarded_or_absent(self) -> None:
        code = """
            import torch
            try:
                from flash_attn import flash_attn_func
            except ImportError:
                flash_attn_func = None
        """
        self.assertCodemod(code, code, **GUARD_FLASH_ATTN)

    def test_guards_module_and_function_level_imports(self) -> None:
        before = """
            import torch
            from flash_attn import flash_attn_func, flash_attn_varlen_func as varlen
            import flash_attn.bert_padding


            def pad(x):
                from flash_attn.bert_padding import pad_input
                return pad_input(x)
        """
        after = """
            import torch
            try:
                from flash_attn import flash_attn_func, flash_attn_varlen_func as varlen
            except ImportError:  # flash_attn is optional: use another attn_implementation
                flash_attn_func = varlen = None
            try:
                import flash_attn.bert_padding
            except ImportError:  # flash_attn is optional: use another attn_implementation
                flash_attn = None


            def pad(x):
                try:
                    from flash_attn.bert_padding import pad_input
                except ImportError:  # flash_attn is optional: use another attn_implementation
                    pad_input = None
                return pad_input(x)
        """
        self.assertCodemod(before, after, **GUARD_FLASH_ATTN)
