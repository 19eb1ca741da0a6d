"""Runner for legacy (LlamaForCausalLM); template family: standard.

dense MHA/GQA; KV cache [batch, kv_heads, seq, head_dim] per layer; causal mask from a 2D padding mask; inputs input_ids, attention_mask, position_ids
Reference recipe for this structure: models/gpt_oss.
"""

# torch only through the engine's guard: with torch_npu installed but no CANN, a plain
# `import torch` fails in torch's backend auto-load.
from engine.model_runner import ModelRunner, torch
from models.configuration_legacy import LlamaConfig
from models.modeling_legacy import LlamaForCausalLM


class LegacyRunner(ModelRunner):
    def __init__(self, runner_settings):
        super().__init__(runner_settings)

    def init_model(self):
        super().init_model(LlamaForCausalLM, LlamaConfig)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.eos_ids = torch.tensor(self.eos_token_ids(), dtype=torch.long, device=self.device)

    def model_input_prepare(self, input_dict):
        attention_mask = input_dict["attention_mask"]
        if input_dict["is_prefill"]:
            input_ids = input_dict["input_ids"]
            # Left padding: positions count real tokens only (as transformers' generate does).
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
        else:
            input_ids = input_dict["next_tokens"][:, None]
            position_ids = input_dict["position_ids"][:, -1:] + 1
        model_inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            self.cache_kwarg: input_dict["cache"],
            "use_cache": True,
        }
        if "logits_to_keep" in self.forward_params:
            model_inputs["logits_to_keep"] = 1  # only the last position's logits are needed
        return model_inputs

    def model_output_process(self, model_inputs, outputs, input_dict):
        next_tokens = outputs.logits[:, -1, :].argmax(dim=-1)
        finished = input_dict["finished"]
        # Finished requests keep receiving the pad token so the batch stays rectangular.
        next_tokens = torch.where(finished, torch.full_like(next_tokens, self.pad_token_id), next_tokens)
        input_dict["generate_ids"] = torch.cat([input_dict["generate_ids"], next_tokens[:, None]], dim=-1)
        input_dict["finished"] = finished | torch.isin(next_tokens, self.eos_ids)
        input_dict["next_tokens"] = next_tokens
        input_dict["position_ids"] = model_inputs["position_ids"]
        mask = input_dict["attention_mask"]
        input_dict["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        input_dict["is_prefill"] = False
        # Eager: the model built its cache at prefill (its own class for hybrid models); keep it.
        returned = outputs.get("cache", outputs.get("past_key_values"))
        if returned is not None:
            input_dict["cache"] = returned

    def model_generate(self, prompts, warm_up=False):
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True, truncation=True,
                                max_length=self.input_max_len).to(self.device)
        batch = inputs["input_ids"].shape[0]
        input_dict = {
            "input_ids": inputs["input_ids"],
            "attention_mask": inputs["attention_mask"],
            "generate_ids": inputs["input_ids"].new_zeros((batch, 0)),
            "finished": torch.zeros(batch, dtype=torch.bool, device=self.device),
            # None in eager mode (the model builds its own), a reused StaticCache in graph mode.
            "cache": self.new_cache(batch, inputs["input_ids"].shape[1] + self.max_new_tokens),
            "is_prefill": True,
        }
        input_lens = inputs["attention_mask"].sum(-1).tolist()
        return super().model_generate(input_dict, input_lens, warm_up)
