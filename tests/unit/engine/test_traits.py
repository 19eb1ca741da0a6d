"""engine/traits.py, how a model steps, asked of the model once: whether its generation step wants the whole
sequence (openai-gpt, cpmant), builds its own inputs (xlm appends its mask token), decodes without the
attention mask (mamba)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("model_type,expected", [("llama", False), ("cpmant", True), ("openai-gpt", True)])
def test_runner_asks_the_model_whether_it_wants_the_whole_sequence(model_type, expected):
    import torch
    from transformers import AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import tiny_config
    from engine.generate import full_sequence_inputs
    from engine.traits import wants_full_sequence

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=384))
    assert wants_full_sequence(model) is expected
    input_dict = {"input_ids": torch.tensor([[0, 5, 6]]), "generate_ids": torch.tensor([[7, 8]])}
    step = full_sequence_inputs({"input_ids": torch.tensor([[8]]), "attention_mask": torch.tensor([[0, 1, 1, 1, 1]]),
                                 "position_ids": torch.tensor([[4]])}, input_dict)
    assert step["input_ids"].tolist() == [[0, 5, 6, 7, 8]]
    assert step["position_ids"].tolist() == [[1, 0, 1, 2, 3]]   # left padding: real tokens count


@pytest.mark.parametrize("model_type,expected", [("llama", False), ("cpmant", False), ("openai-gpt", False),
                                                 ("xlm", True)])
def test_runner_asks_the_model_whether_it_builds_its_own_step(model_type, expected):
    """xlm's prepare_inputs_for_generation appends its mask token and predicts there: the runner
    builds that model's steps with it; the others' steps are a slice of the sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import tiny_config
    from engine.traits import builds_own_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=384))
    assert builds_own_step(model) is expected


@pytest.mark.parametrize("model_type,expected", [("llama", False), ("falcon_h1", False), ("rwkv", False),
                                                 ("mamba", True)])
def test_runner_asks_the_model_whether_its_decode_step_takes_the_mask(model_type, expected):
    """mamba's prepare_inputs_for_generation drops the attention mask after the prompt: the runner's
    decode step does too; the others keep it."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import tiny_config
    from engine.traits import decodes_without_mask

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=384))
    assert decodes_without_mask(model) is expected
