"""The layouts a native framework model runs, refused before anything runs with the parallel_config keys to set
(agent/recipe/native/preflight.py), and the generated file's own guards (agent/recipe/native/parts/code/
causal_lm.py `check_parallel`, parts/code/moe.py `_moe_parallel`) refusing the same layouts. The run that shows the
refusal comes before any rank starts: tests/e2e/test_framework_target.py
(test_attention_data_parallel_with_moe_tensor_parallel_is_refused_before_any_rank_starts)."""

from __future__ import annotations

import ast
import types

import pytest

import native_moe_harness as harness
from agent.recipe.native.preflight import parallel_problem

MOE = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 128,
       "num_local_experts": 8}
DENSE = {key: value for key, value in MOE.items() if key != "num_local_experts"}

DP_WITH_MOE_TP = ("attn_tp_size {a} with moe_tp_size {m} is attention data-parallel with MoE tensor-parallel: the "
                  "generated MoE block all-reduces over moe_tp_group, whose ranks would hold different requests; "
                  "set attn_tp_size to world_size ({w})")
EXPERT_PARALLEL = ("moe_tp_size {m} at world_size {w} is expert parallel (upstream derives moe_ep_size = world_size // "
                   "moe_tp_size = {e}), which the generated MoE block does not run; set {keys} to world_size ({w})")
LMHEAD_OVER_DP = ("lmhead_tp_size {l} with attn_tp_size {a}: the lm head's all-gather would join logits of different "
                  "requests (attention data-parallel, {g} groups of {a} rank(s)); set lmhead_tp_size to attn_tp_size "
                  "({a})")

# (model, world_size, attn_tp_size, moe_tp_size, lmhead_tp_size, the refusal or None)
LAYOUTS = [
    ("moe", 1, 1, 1, 1, None),
    ("moe", 2, 2, 2, 2, None),
    ("moe", 4, 4, 4, 1, None),                      # lm head whole on every rank
    ("moe", 2, 1, 2, 1, DP_WITH_MOE_TP.format(a=1, m=2, w=2)),                     # the maintainer's layout
    ("moe", 4, 2, 4, 2, DP_WITH_MOE_TP.format(a=2, m=4, w=4)),                     # partial attention DP
    ("moe", 2, 2, 1, 2, EXPERT_PARALLEL.format(m=1, w=2, e=2, keys="moe_tp_size")),  # upstream's EP layout
    ("moe", 4, 4, 2, 4, EXPERT_PARALLEL.format(m=2, w=4, e=2, keys="moe_tp_size")),
    ("moe", 2, 1, 1, 1, EXPERT_PARALLEL.format(m=1, w=2, e=2, keys="attn_tp_size and moe_tp_size")),  # pure DP
    ("dense", 2, 1, 1, 1, None),                    # a dense model's attention data-parallel: replicas
    ("dense", 2, 2, 1, 2, None),
    ("dense", 4, 4, 1, 2, None),                    # the lm head's groups inside the attention groups
    ("dense", 2, 1, 1, 2, LMHEAD_OVER_DP.format(l=2, a=1, g=2)),
    ("dense", 4, 2, 1, 4, LMHEAD_OVER_DP.format(l=4, a=2, g=2)),
    ("dense", 3, 2, 1, 1, "world_size 3 does not divide by attn_tp_size 2: choose a size that divides it"),
    ("moe", 4, 4, 8, 4, "world_size 4 does not divide by moe_tp_size 8: choose a size that divides it"),
]


def _config(model: str) -> dict:
    return MOE if model == "moe" else DENSE


def _parallel(world: int, attn: int, moe: int, lmhead: int) -> dict:
    return {"world_size": world, "attn_tp_size": attn, "moe_tp_size": moe, "embed_tp_size": 1, "lmhead_tp_size": lmhead}


@pytest.mark.parametrize("model,world,attn,moe,lmhead,refusal", LAYOUTS,
                         ids=[f"{r[0]}-w{r[1]}-a{r[2]}-m{r[3]}-l{r[4]}" for r in LAYOUTS])
def test_layouts_are_accepted_or_refused_with_the_keys_to_set(model, world, attn, moe, lmhead, refusal):
    assert parallel_problem(_config(model), _parallel(world, attn, moe, lmhead)) == refusal


@pytest.mark.parametrize("value", ["2", 0, -2, 1.5, True, None])
def test_a_size_that_is_not_a_whole_number_of_ranks_is_one_line(value):
    """None: an empty key (`attn_tp_size:`), which upstream's ParallelConfig reads as None and fails on."""
    problem = parallel_problem(DENSE, {"world_size": 2, "attn_tp_size": value, "lmhead_tp_size": 1})
    assert problem == f"parallel_config's attn_tp_size {value!r} is not a whole number of ranks: set it to one (1 or more)"
    assert parallel_problem(DENSE, {"world_size": 2, "lmhead_tp_size": 1}) is None      # absent: upstream's default 1


def test_advice_followed_is_accepted():
    """Each refusal's `set KEYS to world_size (N)` / `set lmhead_tp_size to attn_tp_size (A)`, applied, passes."""
    for model, world, attn, moe, lmhead, refusal in LAYOUTS:
        if refusal is None or "does not divide" in refusal:
            continue
        parallel = _parallel(world, attn, moe, lmhead)
        advice = refusal.rsplit("; set ", 1)[1]
        keys, value = advice.split(" to ")
        number = int(value[value.index("(") + 1:value.index(")")])
        for key in keys.split(" and "):
            parallel[key] = number
        assert parallel_problem(_config(model), parallel) is None, (refusal, parallel)


# ---- the generated file's guards refuse the same layouts ---------------------------------------------
@pytest.fixture(scope="module")
def generated_guards():
    """`check_parallel` of a rendered dense native file, and the rendered MoE block."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native
    from agent.recipe.native.parts.moe import derive_moe, render_moe

    if not harness.UPSTREAM.is_dir():
        pytest.skip(f"no upstream snapshot at {harness.UPSTREAM} (module/linear.py)")
    harness.ensure_imports()
    text = render_native({"model_name": "tiny_llama", "framework_class": "TinyForCausalLM", "display_name": "llama",
                          "model_class": "ForCausalLM", "transformers_version": "5.0.0"},
                         derive(AutoConfig.for_model("llama").to_dict()))
    function = next(node for node in ast.parse(text).body
                    if isinstance(node, ast.FunctionDef) and node.name == "check_parallel")
    namespace: dict = {}
    exec(compile(ast.Module([function], []), "check_parallel", "exec"), namespace)     # noqa: S102 - our own render
    config = harness.shrunk_config("mixtral")
    block = harness.load_generated(render_moe(derive_moe(config)), "mixtral_layouts").MixtralSparseMoeBlock
    return namespace["check_parallel"], block, config


class _Ranks:
    def get_rank(self, name):
        return 0


@pytest.mark.parametrize("model,world,attn,moe,lmhead,refusal",
                         [row for row in LAYOUTS if row[5] is None or "does not divide" not in row[5]],
                         ids=[f"{r[0]}-w{r[1]}-a{r[2]}-m{r[3]}-l{r[4]}" for r in LAYOUTS
                              if r[5] is None or "does not divide" not in r[5]])
def test_the_generated_file_refuses_the_same_layouts(generated_guards, model, world, attn, moe, lmhead, refusal):
    """What preflight refuses, the generated file refuses too (for a YAML run without the migrator), naming the
    same keys; what it accepts, the generated file builds."""
    check_parallel, block, config = generated_guards
    shrunk = types.SimpleNamespace(**{**DENSE, "hidden_size": 64})     # heads and widths that split at 4
    refused = []
    try:
        check_parallel(shrunk, types.SimpleNamespace(attn_tp_size=attn, lmhead_tp_size=lmhead, moe_tp_size=moe,
                                                     world_size=world))
    except ValueError as exc:
        refused.append(str(exc))
    if model == "moe":
        try:
            block(config, harness.infer_config(moe_tp_size=moe, world_size=world, attn_tp_size=attn), _Ranks())
        except ValueError as exc:
            refused.append(str(exc))
    assert bool(refused) == (refusal is not None), (refused, refusal)
    if refusal is not None:
        keys = refusal.rsplit("; set ", 1)[1].split(" to ")[0].split(" and ")
        assert all(key in refused[0].rsplit("; set ", 1)[1] for key in keys), (refused, refusal)
        assert "\n" not in refused[0]
