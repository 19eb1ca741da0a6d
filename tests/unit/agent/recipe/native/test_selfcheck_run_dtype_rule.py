"""The self-check's rule for the run dtype (agent/recipe/native/selfcheck.py run_dtype_tolerances): RUN_DTYPE_SLACK x
the precision verdict's tolerance, transformers' own bfloat16 move at a step taken as the largest over the step's
sequences and over two of transformers' computations of the model (its eager attention and experts, and sdpa /
grouped_mm), as the verdict takes the larger of its row-parallel and expert-parallel computations. One sequence's
move under one computation is one draw of the rounding's noise: on the defaults of bitnet, granitemoeshared,
qwen3_5_moe and minimax_m3 a draw small by chance (bitnet's 3-token prompt moved 0.27 where the step's others moved
1.5 and 0.49; minimax_m3's eager experts 0.14 where grouped_mm moved 1.15) failed files that transformers'
arithmetic, dtype for dtype, computes the same way (their other seeds pass at 0.25-0.9 of the tolerance). A file
off by more than the largest of those draws still fails."""

from __future__ import annotations

import pytest


def _logits(*values):
    import torch

    return torch.tensor(values, dtype=torch.float32)


def test_the_step_tolerance_is_the_largest_move_of_its_sequences_and_computations():
    from agent.precision_rule import tolerance
    from agent.recipe.native.selfcheck import RUN_DTYPE, RUN_DTYPE_SLACK, run_dtype_tolerances

    # per sequence: float32, transformers' eager bfloat16, its sdpa / grouped_mm bfloat16
    rows = [[_logits(10.0, 0.0), _logits(10.2, 0.0), _logits(10.1, 0.0)],     # moved 0.2
            [_logits(8.0, 1.0), _logits(8.0, 1.0), _logits(8.0, 1.9)],        # its second computation moved 0.9
            [_logits(9.0, 2.0), _logits(9.01, 2.0), _logits(9.0, 2.0)]]       # moved 0.01: a lucky draw
    allowed = run_dtype_tolerances(rows, RUN_DTYPE)
    assert allowed == pytest.approx([RUN_DTYPE_SLACK * tolerance(0.9, scale, RUN_DTYPE) for scale in (10.0, 8.0, 9.0)],
                                    rel=1e-6)
    # the third sequence's own draw alone would have held it to 2 x 2 x 0.01
    assert allowed[2] > 50 * RUN_DTYPE_SLACK * tolerance(0.01, 9.0, RUN_DTYPE)


def test_a_file_off_by_more_than_the_largest_draw_fails_and_noise_passes():
    """The rule still fails a systematic loss: a file whose logits sit 5x the step's largest move of transformers'
    own from float32 (RUN_DTYPE_SLACK x the verdict's noise factor is 4x) fails; one within transformers' own
    moves passes. Floors: a step where transformers did not move at all holds a file to 1e-3 of the logits."""
    import torch

    from agent.recipe.native.selfcheck import RUN_DTYPE, run_dtype_tolerances

    fp32 = _logits(12.0, -3.0, 4.0)
    rows = [[fp32, fp32 + torch.tensor([0.3, 0.0, 0.0]), fp32 + torch.tensor([0.0, 0.2, 0.0])],
            [fp32, fp32 + torch.tensor([0.1, 0.0, 0.0]), fp32]]
    allowed = run_dtype_tolerances(rows, RUN_DTYPE)
    faulty, noisy = 5 * 0.3, 0.25
    assert not faulty <= allowed[1] and noisy <= allowed[1]
    assert run_dtype_tolerances([[fp32, fp32, fp32]], RUN_DTYPE) == pytest.approx([2 * 1e-3 * 12.0])


@pytest.mark.slow
def test_the_second_computation_is_transformers_other_attention_and_experts():
    """other_implementations: eager -> sdpa, eager experts -> grouped_mm, and back. Default-suite coverage of the
    same path: every bfloat16 self-check job runs it (test_mla_features.py's
    test_the_run_dtype_and_the_kernels_widths_fail_what_float32_passes, its bfloat16-only fault failing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent.recipe.native.selfcheck import other_implementations

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  num_experts=4, num_experts_per_tok=2, vocab_size=64)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    before = (model.config._attn_implementation, model.config._experts_implementation)
    other_implementations(model)
    after = (model.config._attn_implementation, model.config._experts_implementation)
    assert before == ("eager", "eager") and after == ("sdpa", "grouped_mm"), (before, after)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[3, 5, 7]])).logits).all()
    other_implementations(model)
    assert (model.config._attn_implementation, model.config._experts_implementation) == ("eager", "eager")


def test_the_other_computation_leaves_the_first_references_implementations():
    """Each reference model holds its own config: switching the second to transformers' other attention and experts
    leaves the float32 reference and the first run-dtype one on theirs (transformers' from_config keeps the config
    object it is handed, and its modules read the implementation from it at every forward)."""
    from transformers import AutoConfig

    from agent.recipe.native.selfcheck import other_implementations, reference_model

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  num_experts=4, num_experts_per_tok=2, vocab_size=64)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    first, second = reference_model(config), reference_model(config)
    other_implementations(second)
    assert (second.config._attn_implementation, second.config._experts_implementation) == ("sdpa", "grouped_mm")
    assert (first.config._attn_implementation, first.config._experts_implementation) == ("eager", "eager")
    assert (config._attn_implementation, config._experts_implementation) == ("eager", "eager")
