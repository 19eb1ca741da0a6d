"""agent/codemods/commands/decode_attention_mask.py (upstream's common issue: the prefill mask passed at decode):
the mask is None at decode."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.decode_attention_mask import DecodeAttentionMaskCommand


class TestDecodeAttentionMaskCommand(CodemodTest):
    TRANSFORM = DecodeAttentionMaskCommand

    def test_noop_when_the_function_branches_on_is_prefill(self) -> None:
        code = """
            def forward(self, x, forward_metadata):
                if forward_metadata.is_prefill:
                    atten_mask = forward_metadata.attention_mask
                else:
                    atten_mask = None
        """
        self.assertCodemod(code, code)

    def test_a_function_reading_is_prefill_for_other_things_still_gets_the_branch(self) -> None:
        """upstream qwen's attention: is_prefill decides the prompt padding, the mask is read for both."""
        before = """
            def forward(self, x, forward_metadata):
                is_prefill = forward_metadata.is_prefill
                if is_prefill:
                    x = x[:4]
                attention_mask = forward_metadata.attention_mask
        """
        after = """
            def forward(self, x, forward_metadata):
                is_prefill = forward_metadata.is_prefill
                if is_prefill:
                    x = x[:4]
                attention_mask = forward_metadata.attention_mask if forward_metadata.is_prefill else None
        """
        self.assertCodemod(before, after)

    def test_prefill_mask_only_at_prefill(self) -> None:
        before = """
            def forward(self, x, kwargs):
                atten_mask = kwargs.forward_metadata.attention_mask
        """
        after = """
            def forward(self, x, kwargs):
                atten_mask = kwargs.forward_metadata.attention_mask if kwargs.forward_metadata.is_prefill else None
        """
        self.assertCodemod(before, after)
