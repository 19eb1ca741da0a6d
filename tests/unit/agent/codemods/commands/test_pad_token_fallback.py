"""agent/codemods/commands/pad_token_fallback.py: a tokenizer without a pad token falls back to its EOS token."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.pad_token_fallback import PadTokenFallbackCommand


class TestPadTokenFallbackCommand(CodemodTest):
    TRANSFORM = PadTokenFallbackCommand

    def test_noop_when_fallback_present_or_no_tokenizer(self) -> None:
        code = """
            class R:
                def init_model(self):
                    self.config = AutoConfig.from_pretrained(self.model_path)
                    self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                    if self.tokenizer.pad_token is None:
                        self.tokenizer.pad_token = self.tokenizer.eos_token
        """
        self.assertCodemod(code, code)

    def test_fallback_after_the_load(self) -> None:
        before = """
            tokenizer = LlamaTokenizerFast.from_pretrained(path)
            print(tokenizer)
        """
        after = """
            tokenizer = LlamaTokenizerFast.from_pretrained(path)
            if tokenizer.pad_token is None:  # batches need padding: pad with EOS (masked out)
                tokenizer.pad_token = tokenizer.eos_token
            print(tokenizer)
        """
        self.assertCodemod(before, after)
