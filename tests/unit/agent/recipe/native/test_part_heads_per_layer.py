"""Query heads per layer (agent/recipe/native/parts/attention_heads.py; the fused attention's HEADS_PER_LAYER in
parts/code/attention_fused.py): laguna's config.num_attention_heads_per_layer read as the layers' query heads (the
key's values are each attention layer's q_proj heads, on the checkpoint's config and on one with them varied); the
file builds each layer with its own heads, splits each layer's at the attention's tensor-parallel size
(check_parallel, and preflight before a run), and the self-check runs the varied-heads setting too.

Default: laguna's composition on a small config of two layers of unequal heads (a sliding and a full one, a dense
and a sparse MLP), the reading of the key against coincidences, and preflight on per-layer counts. Slow: the file
held to transformers in float32, bfloat16 and every family setting (the varied heads among them), the file building
every layer with num_attention_heads (must fail) and another fault, and the generated file's own check_parallel."""

from __future__ import annotations

import ast
import re
from types import SimpleNamespace

import pytest

from part_selfcheck import ctx, selfcheck_with_faults

# laguna at a small size: 48 and 64 query heads over 8 key/value heads (shrunk: 12 and 16 over 2)
SMALL = {"num_hidden_layers": 2, "num_attention_heads_per_layer": [48, 64],
         "layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"]}
GLOBAL_HEADS = ("self.num_heads = config.num_attention_heads_per_layer[layer_idx]",
                "self.num_heads = config.num_attention_heads")
FAULTS = [GLOBAL_HEADS,
          # laguna's softplus gate as afmoe's sigmoid
          ("gate = torch.nn.functional.softplus(gate.float()).to(out.dtype)", "gate = torch.sigmoid(gate)")]


@pytest.fixture(scope="module")
def derived():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = {**AutoConfig.for_model("laguna").to_dict(), **SMALL}
    return config, derive(config)


@pytest.fixture(scope="module")
def check_parallel(derived):
    """The rendered file's check_parallel, on its own (the options folded into it)."""
    from agent.recipe.native.decide import render_native

    tree = ast.parse(render_native(ctx("laguna", "NativeForCausalLM"), derived[1]))
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check_parallel")
    namespace: dict = {}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "check_parallel", "exec"), namespace)  # noqa: S102
    return namespace["check_parallel"]


def test_the_heads_key_is_read_and_its_variant_checked(derived):
    _, composition = derived
    assert composition.parts["attention"] == "fused_paged"
    assert composition.options["HEADS_PER_LAYER"] == "num_attention_heads_per_layer"
    varied = dict(composition.checked_variants)["query heads per layer varied"]["num_attention_heads_per_layer"]
    assert varied == [12, 18]           # the shrunk [12, 16], the odd layer one more group of 2 key/value heads


CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_attention_heads_per_layer": [12, 16],
          "vocab_size": 48, "intermediate_size": 96}
# attn_tp_size -> what does not split: 12 and 16 heads (the global 4 builds no layer: not checked); 8 splits layer
# 1's, not layer 0's
SPLITS = [(4, None), (8, "num_attention_heads_per_layer[0] 12 does not divide"),
          (3, "num_attention_heads_per_layer[1] 16 does not divide")]


@pytest.mark.parametrize("tp, problem", SPLITS)
def test_preflight_splits_each_layers_heads(tp, problem):
    from agent.recipe.native.preflight import parallel_problem

    found = parallel_problem(CONFIG, {"world_size": tp, "attn_tp_size": tp, "lmhead_tp_size": 1})
    assert found is None if problem is None else found.startswith(problem), found


@pytest.mark.slow
@pytest.mark.parametrize("tp, problem", SPLITS)
def test_the_files_check_parallel_splits_each_layers_heads(check_parallel, tp, problem):
    """The generated file's own check (it runs before the executor builds the model). Default-suite coverage of the
    rule: test_preflight_splits_each_layers_heads."""
    parallel = SimpleNamespace(attn_tp_size=tp, lmhead_tp_size=1, embed_tp_size=1, cp_size=1)
    if problem is None:
        check_parallel(SimpleNamespace(**CONFIG), parallel)
    else:
        with pytest.raises(ValueError, match=re.escape(problem)):
            check_parallel(SimpleNamespace(**CONFIG), parallel)


@pytest.mark.slow
def test_every_setting_matches_transformers_and_the_faults_fail(derived, tmp_path):
    """The file held to transformers in float32 and bfloat16 and on every family setting (the heads varied per layer,
    mlp_layer_types, shared experts, rope types, biases, tied embeddings); the file building every layer with
    num_attention_heads, and the gate's softplus as a sigmoid, must fail. Slow: the stand-in self-check alone is over
    the default suite's budget for a part (~11 s of CPU). Default-suite coverage of the same path: the composition
    that writes it (test_the_heads_key_is_read_and_its_variant_checked) and the rule that reads it
    (test_a_list_is_the_heads_only_where_the_widths_follow_it); the per-step self-check of every type's file,
    laguna's among them, is scripts/native_coverage.py."""
    rows = selfcheck_with_faults({"laguna": derived}, {"laguna": FAULTS}, "NativeForCausalLM", tmp_path,
                                 keep=lambda label: True)
    assert any(label == "query heads per layer varied" for _, label, _, _ in rows)


def _fake_probe(values: list, follows: bool, head_dim: int = 4, per_value: int = 1):
    """A probe-like record of two attention layers whose q_proj widths are `per_value` x `values` heads, and whose
    variant's widths follow the changed list (`follows`) or stay as they were."""
    import torch

    def layers(heads):
        built = []
        for count in heads:
            attention = torch.nn.Module()
            attention.add_module("q_proj", torch.nn.Linear(8, per_value * count * head_dim, bias=False))
            built.append(SimpleNamespace(self_attn=attention))
        return built

    def probe(heads, listed):
        config = SimpleNamespace(num_hidden_layers=2, heads_list=listed, to_dict=lambda: {"heads_list": listed})
        record = SimpleNamespace(config=config, layers=layers(heads), head_dim=head_dim, kv_heads=2, heads=2, memo={})
        record.variant = lambda changes: probe(changes["heads_list"] if follows else heads, changes["heads_list"])
        return record

    return probe(values, values)


@pytest.mark.parametrize("follows, per_value", [(True, 1), (False, 1), (True, 2)])
def test_a_list_is_the_heads_only_where_the_widths_follow_it(follows, per_value):
    """A list that equals the layers' query heads is their key only where a variant of it moves the q_proj widths
    too (a coincidence does not), and only where it counts the heads themselves (hunyuan_v1_moe's moe_topk [2, 2]
    beside 4 heads, varied to [2, 4], had layer 1 at twice its value both times)."""
    from agent.recipe.native.parts.attention_heads import heads_per_layer

    found = heads_per_layer(_fake_probe([2, 4] if per_value == 1 else [2, 2], follows, per_value=per_value))
    assert found == (("heads_list", {"heads_list": [2, 6]}) if follows and per_value == 1 else None)
