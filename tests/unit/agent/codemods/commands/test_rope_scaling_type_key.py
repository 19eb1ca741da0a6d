"""agent/codemods/commands/rope_scaling_type_key.py: rope_scaling['type'] read with transformers 5's 'rope_type'
as fallback."""

from libcst.codemod import CodemodTest


class TestRopeScalingTypeKey(CodemodTest):
    from agent.codemods.commands.rope_scaling_type_key import RopeScalingTypeKeyCommand as TRANSFORM

    def test_noop(self):
        code = "kind = config.rope_scaling['rope_type']\nconfig.rope_scaling['type'] = 'linear'\nx = other['type']\n"
        self.assertCodemod(code, code)

    def test_type_key_reads_rope_type_too(self):
        before = 'scaling_type = self.config.rope_scaling["type"]\nf = rope_scaling["type"]\n'
        after = ('scaling_type = self.config.rope_scaling.get("type", self.config.rope_scaling.get("rope_type"))\n'
                 'f = rope_scaling.get("type", rope_scaling.get("rope_type"))\n')
        self.assertCodemod(before, after)
