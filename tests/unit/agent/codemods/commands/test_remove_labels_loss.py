"""agent/codemods/commands/remove_labels_loss.py: the training loss (labels) removed from a vendored model's
forward."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.remove_labels_loss import RemoveLabelsLossCommand


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
