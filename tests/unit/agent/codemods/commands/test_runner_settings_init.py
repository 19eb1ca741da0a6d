"""agent/codemods/commands/runner_settings_init.py: a vendored model's constructor takes the runner's settings."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.runner_settings_init import RunnerSettingsInitCommand


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
