"""The layouts a native framework model runs, refused before anything runs with the parallel_config keys to set
(agent/recipe/native/preflight.py), and the generated file's own guards (agent/recipe/native/parts/code/
causal_lm.py `check_parallel`, parts/code/moe.py `MoeLayout`) refusing the same layouts. The run that shows a
refusal comes before any rank starts: tests/e2e/test_framework_target.py
(test_a_layout_that_cannot_run_is_refused_before_any_rank_starts)."""

from __future__ import annotations

import ast
import types

import pytest

import native_moe_harness as harness
from agent.recipe.native.preflight import parallel_problem

MOE = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 128,
       "num_local_experts": 8}
DENSE = {key: value for key, value in MOE.items() if key != "num_local_experts"}

EXPERTS_DO_NOT_SPLIT = ("{n} routed experts do not split over moe_ep_size {e} (upstream derives world_size {w} // "
                        "moe_tp_size {m}); set moe_tp_size to {fit} (moe_ep_size {fe})")
BATCH_OVER_DP = ("scheduler_config's batch_size {b} does not split over {g} attention data-parallel groups (world_size "
                 "{w} // attn_tp_size {a}); set batch_size to a multiple of {g}")

# (model, world_size, attn_tp_size, moe_tp_size, lmhead_tp_size, the refusal or None); batch_size 4, 8 experts
LAYOUTS = [
    ("moe", 1, 1, 1, 1, None),
    ("moe", 2, 2, 2, 2, None),
    ("moe", 4, 4, 4, 1, None),                      # lm head whole on every rank
    ("moe", 2, 1, 2, 1, None),                      # attention DP, MoE TP: moe_tp_group gathers both requests
    ("moe", 4, 2, 4, 2, None),                      # partial attention DP
    ("moe", 2, 2, 1, 2, None),                      # upstream's EP layout (moe_ep_size 2)
    ("moe", 4, 4, 2, 4, None),                      # TP 2 x EP 2
    ("moe", 2, 1, 1, 1, None),                      # attention DP + EP
    ("moe", 4, 1, 1, 1, None),                      # attention DP 4 + EP 4 (2 experts a rank)
    ("moe", 16, 4, 1, 4, EXPERTS_DO_NOT_SPLIT.format(n=8, e=16, w=16, m=1, fit=2, fe=8)),
    ("moe", 8, 1, 1, 8, BATCH_OVER_DP.format(b=4, g=8, w=8, a=1)),
    ("dense", 2, 1, 1, 1, None),                    # a dense model's attention data-parallel: replicas
    ("dense", 2, 2, 1, 2, None),
    ("dense", 4, 4, 1, 2, None),                    # the lm head's groups inside the attention groups
    ("dense", 2, 1, 1, 2, None),                    # the lm head over two requests' groups: gathered first
    ("dense", 4, 2, 1, 4, None),
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
    assert parallel_problem(_config(model), _parallel(world, attn, moe, lmhead), batch_size=4) == refusal


@pytest.mark.parametrize("value", ["2", 0, -2, 1.5, True, None])
def test_a_size_that_is_not_a_whole_number_of_ranks_is_one_line(value):
    """None: an empty key (`attn_tp_size:`), which upstream's ParallelConfig reads as None and fails on."""
    problem = parallel_problem(DENSE, {"world_size": 2, "attn_tp_size": value, "lmhead_tp_size": 1})
    assert problem == f"parallel_config's attn_tp_size {value!r} is not a whole number of ranks: set it to one (1 or more)"
    assert parallel_problem(DENSE, {"world_size": 2, "lmhead_tp_size": 1}) is None      # absent: upstream's default 1


def test_advice_followed_is_accepted():
    """Each refusal's advice (`set moe_tp_size to M`, `set batch_size to a multiple of G`), applied, passes."""
    for model, world, attn, moe, lmhead, refusal in LAYOUTS:
        if refusal is None or "does not divide" in refusal:
            continue
        parallel, batch = _parallel(world, attn, moe, lmhead), 4
        key, value = refusal.rsplit("; set ", 1)[1].split(" to ")
        if key == "batch_size":
            batch = int(value.rsplit(" ", 1)[1])
        else:
            parallel[key] = int(value.split(" ")[0])
        assert parallel_problem(_config(model), parallel, batch_size=batch) is None, (refusal, parallel)


CP_NEEDS = ("cp_size {c} with world_size {w} and attn_tp_size {a}: upstream's prefill context parallel needs cp_size "
            "equal to world_size and attn_tp_size 1; set cp_size {w} and attn_tp_size 1, or cp_size 1")
# (world_size, attn_tp_size, cp_size, the refusal or None): upstream's ParallelConfig rule, said before ranks start
CP_LAYOUTS = [
    (2, 1, 2, None),
    (4, 1, 4, None),
    (1, 1, 1, None),
    (4, 1, 2, CP_NEEDS.format(c=2, w=4, a=1)),
    (2, 2, 2, CP_NEEDS.format(c=2, w=2, a=2)),
    (4, 2, 4, CP_NEEDS.format(c=4, w=4, a=2)),
    (3, 1, 2, "world_size 3 does not divide by cp_size 2: choose a size that divides it"),
]


@pytest.mark.parametrize("world,attn,cp,refusal", CP_LAYOUTS, ids=[f"w{r[0]}-a{r[1]}-cp{r[2]}" for r in CP_LAYOUTS])
def test_context_parallel_layouts_are_upstreams(world, attn, cp, refusal):
    parallel = {"world_size": world, "attn_tp_size": attn, "cp_size": cp, "lmhead_tp_size": 1}
    assert parallel_problem(DENSE, parallel, batch_size=4) == refusal


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
    """The comm manager's calls the block makes when it is built: rank 0 of every group."""

    def get_rank(self, name):
        return 0

    def get_group_name(self, name):
        return name


GENERATED = [row for row in LAYOUTS if row[5] is None or "routed experts" in row[5]]


@pytest.mark.parametrize("model,world,attn,moe,lmhead,refusal", GENERATED,
                         ids=[f"{r[0]}-w{r[1]}-a{r[2]}-m{r[3]}-l{r[4]}" for r in GENERATED])
def test_the_generated_file_refuses_the_same_layouts(generated_guards, model, world, attn, moe, lmhead, refusal):
    """What preflight refuses of the model's own layout, the generated file refuses too (for a YAML run without the
    migrator), in the same words; what it accepts, the generated file builds (the batch rule is upstream infer.py's
    own refusal)."""
    check_parallel, block, config = generated_guards
    shrunk = types.SimpleNamespace(**{**DENSE, "hidden_size": 64})     # heads and widths that split at 4
    refused = []
    try:
        check_parallel(shrunk, types.SimpleNamespace(attn_tp_size=attn, lmhead_tp_size=lmhead, moe_tp_size=moe,
                                                     embed_tp_size=1, world_size=world))
    except ValueError as exc:
        refused.append(str(exc))
    if model == "moe":
        try:
            block(config, harness.infer_config(moe_tp_size=moe, world_size=world, attn_tp_size=attn), _Ranks())
        except ValueError as exc:
            refused.append(str(exc))
    assert refused == ([refusal] if refusal else []), (refused, refusal)
