"""gemma4's layers: head width per layer, the value norm and the layer scalar
(agent/recipe/native/parts/attention_head_dim.py, value_norm in parts/attention.py, layer_scalar in
parts/block.py; the fused attention's HEAD_DIM_PER_LAYER and V_NORM in parts/code/attention_fused.py, the rotary
tables per layer type at each type's width in parts/code/causal_lm.py, LAYER_SCALAR in parts/code/block.py).
gemma4's heterogeneous config sets head_dim per layer (its full-attention layers at global_head_dim 512 beside the
sliding layers' 256); the probe reads each layer's, checks each layer's q/k projections and q/k norms at its own
width, and the softmax scale's rule per layer; its v_norm is read numerically as a weightless RMSNorm per head; its
layer_scalar (a checkpoint buffer, 1 in a random model) is read set to 2 as multiplying the layer's whole output.

Default: the facts on gemma4's defaults with the per-layer input embeddings off (the model slot's blocker before
these), a v_norm that is not weightless refused, a layer scalar that does not scale the output refused. Slow: that
config's file held to transformers in float32, bfloat16 and every family setting, and its faults (every layer
built at the first layer's head_dim, the value norm dropped, every rotary table at the sliding layers' width) must
fail. The layer scalar has no fault here: it is 1 in transformers' random model, so the self-check cannot see it
dropped (its reading is test_the_layer_scalar_multiplies_the_whole_output).

gemma-4-26B's shape adds key/value heads per layer, keys as values, and the sparse-MoE branch beside the dense MLP
(parts/moe_scaled_router.py: the layer's own router and experts; parts/block_moe_beside_mlp.py: the two branches
normed, summed and normed): read by default (and a router without its norm or scales, a branch without its output
norm, refused); slow, held to transformers with the branch's faults."""

from __future__ import annotations

import pytest

# gemma4's defaults without the per-layer input embeddings (hidden_size_per_layer_input: no part writes them yet)
NO_PLE = {"hidden_size_per_layer_input": 0}
FAULTS = [("self.head_dim = config.per_layer_config[layer_idx].head_dim",
           "self.head_dim = config.per_layer_config[0].head_dim"),
          ("value = (value * torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + self.v_norm_eps)).to(key.dtype)",
           "value = value.to(key.dtype)"),
          ("NativeRotaryEmbedding(config, config.per_layer_config[kind].head_dim,",
           "NativeRotaryEmbedding(config, config.per_layer_config[0].head_dim,")]
# gemma-4-26B's shape without its MoE branch (no part writes it yet): the key heads per layer and keys as values
DENSE_26B_DROPPED = ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")
# gemma-4-26B's sparse-MoE branch beside the dense MLP: the router's per_expert_scale, its weightless norm and its
# scale dropped, the experts' norm dropped, the branch's output norm dropped, the gelu on the up half (npu_geglu's
# default); each must fail (the self-check's random model has scale / per_expert_scale off 1: selfcheck.randomise)
MOE_26B_FAULTS = [("weights = weights * router.per_expert_scale.float()[expert_ids.long()]", "weights = weights"),
                  ("logits = router(normed * router.scale * self.hidden_size ** -0.5)",
                   "logits = router(hidden_states * router.scale * self.hidden_size ** -0.5)"),
                  ("logits = router(normed * router.scale * self.hidden_size ** -0.5)",
                   "logits = router(normed * self.hidden_size ** -0.5)"),
                  ("hidden_states = self.pre_feedforward_layernorm_2(hidden_states)", "hidden_states = hidden_states"),
                  ("routed = self.post_feedforward_layernorm_2(self.moe_block(residual))",
                   "routed = self.moe_block(residual)"),
                  ("approximate=1, activate_left=True)", "approximate=1, activate_left=False)")]
DENSE_26B_FAULTS = [("self.num_key_value_heads = config.per_layer_config[layer_idx].num_key_value_heads",
                     "self.num_key_value_heads = config.per_layer_config[0].num_key_value_heads"),
                    ('                if shard == "k":\n                    loader(param, weight, "v")',
                     '                if shard == "never":\n                    loader(param, weight, "v")')]


@pytest.fixture(scope="module")
def gemma4_probe():
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    try:
        config = AutoConfig.for_model("gemma4_text", **NO_PLE).to_dict()
    except (ValueError, KeyError):
        pytest.skip("this transformers has no gemma4_text")
    return Probe(config)


def test_each_layer_is_read_at_its_own_head_width(gemma4_probe):
    from agent.recipe.native.parts.attention import dense_attention

    probe = gemma4_probe
    kinds = probe.config.layer_types
    assert probe.layer_head_dims == [512 if kind == "full_attention" else 256 for kind in kinds]
    assert {256, 512} == set(probe.layer_head_dims)
    facts = dense_attention(probe)
    # the q/k norms per head at each layer's width; scaling 1.0 (the q/k norms stand in for the softmax scale)
    assert facts["HEAD_DIM_PER_LAYER"] is True and facts["V_NORM"] is True
    assert facts["QK_NORM"] is True and facts["UNSCALED"] is True and facts["LAYER_TYPE_WINDOWS"] is True


@pytest.fixture(scope="module")
def checkpoint_probe():
    """The probe of google/gemma-4-26B-A4B's text shape: its full layers' 2 key/value heads beside the sliding
    layers' 8 shrink to 1 beside 2 (agent.recipe.shrink keeps a kind's fewer key heads fewer)."""
    from agent.recipe.native.parts.probe import Probe
    from agent.testing.checkpoint_shapes import checkpoint_config

    try:
        config, _ = checkpoint_config("gemma4_text")
        return Probe(config)
    except (ValueError, KeyError):
        pytest.skip("this transformers has no gemma4_text")


def test_key_heads_per_layer_and_keys_as_values_are_read(checkpoint_probe):
    """Each layer's key/value heads from per_layer_config (each layer's k_proj checked at its own count), and the
    full layers without v_proj read numerically as taking k_proj's output for values, the key and kinds recorded."""
    from agent.recipe.native.parts.attention import dense_attention
    from agent.recipe.native.parts.attention_heads import key_heads_by_kind, layer_key_heads

    probe = checkpoint_probe
    kinds = probe.config.layer_types
    assert probe.layer_kv_heads == [1 if kind == "full_attention" else 2 for kind in kinds]
    assert [layer_key_heads(probe, index) for index in range(len(kinds))] == probe.layer_kv_heads
    assert key_heads_by_kind(probe) is None          # stated by the config: no code rule
    facts = dense_attention(probe)
    assert facts["KV_HEADS_PER_LAYER"] is True and facts["HEAD_DIM_PER_LAYER"] is True
    assert facts["K_EQ_V"] == ("attention_k_eq_v", ("full_attention",))


@pytest.fixture(scope="module")
def checkpoint_composition(checkpoint_probe):
    from agent.recipe.native.compose import compose

    return compose(checkpoint_probe)


def test_the_checkpoints_moe_branch_beside_the_dense_mlp_is_read(checkpoint_composition):
    """gemma4-26B's layers hold a router and experts beside the dense MLP: the router read numerically (on the
    residual stream, its own weightless norm, scale, 1 / sqrt(hidden), softmax top-k renormalised, per_expert_scale),
    the experts as gelu-tanh over gate / up halves (npu_geglu) behind pre_feedforward_layernorm_2, the layer's two
    branches normed, summed and normed again (post_feedforward_layernorm_1 / _2, then post_feedforward_layernorm)."""
    composition = checkpoint_composition
    assert composition.parts["moe"] == "sparse_moe_scaled_router"
    assert composition.parts["block"] == "sandwich_moe_beside_mlp"
    assert composition.parts["mlp"] == "gated_mlp"
    options = composition.options
    assert options["GEGLU"] is True and options["EXPERTS_NORM"] == "pre_feedforward_layernorm_2"
    assert (options["TOPK_KEY"], options["EXPERTS_KEY"], options["WIDTH_KEY"]) == \
        ("top_k_experts", "num_experts", "moe_intermediate_size")
    assert options["ROUTER_STORED"] == "router.proj" and options["FUSED_LAYOUT"] == "E,2I,H"
    assert (options["MLP_OUT_NORM"], options["MOE_OUT_NORM"], options["BRANCHES_NORM"]) == \
        ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "post_feedforward_layernorm")
    assert options["LAYER_SCALAR"] is True
    # the layer's own router / experts and the experts' norm load into the native layer's moe_block
    assert ("\\.router\\.", ".moe_block.router.") in options["CHECKPOINT_RENAMES"]
    assert ("\\.pre_feedforward_layernorm_2\\.", ".moe_block.pre_feedforward_layernorm_2.") in \
        options["CHECKPOINT_RENAMES"]


def test_the_scaled_router_block_matches_transformers_branch(checkpoint_probe, checkpoint_composition):
    """The block's code (code/moe_scaled_router.py over code/moe.py, rendered alone with the derived options) against
    transformers' layer's own router and experts on one residual stream (its router's scale and per_expert_scale off
    1), float32 under the stand-in's reference kernels; the same block with per_expert_scale dropped differs."""
    import copy

    import torch

    import native_moe_harness as harness
    from agent.recipe.native.assemble import assemble
    from agent.recipe.native.parts import OPTION_NAMES

    if not harness.UPSTREAM.is_dir():
        pytest.skip(f"no upstream snapshot at {harness.UPSTREAM}")
    options = checkpoint_composition["moe"].options
    source = assemble(["norm_rms.py", "moe_scaled_router.py"], options=options, option_names=OPTION_NAMES,
                      roles={"Norm": "ModelRMSNorm"}, prefix="Gemma4Text", framework_class="Gemma4TextForCausalLM",
                      keep=("ModelScaledRouterSparseMoeBlock",), header="# coding=utf-8")
    layer = copy.deepcopy(checkpoint_probe.layers[0])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.startswith(("router.", "experts.", "pre_feedforward_layernorm_2.")):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen) if param.dim() == 1
                            else torch.randn(param.shape, generator=gen) * 0.3)
    tensors = [(name, tensor) for name, tensor in layer.state_dict().items()
               if name.startswith(("router.", "experts.", "pre_feedforward_layernorm_2."))]
    x = torch.randn(13, checkpoint_probe.hidden, generator=gen)
    with torch.no_grad():
        _, weights, index = layer.router(x)
        want = layer.experts(layer.pre_feedforward_layernorm_2(x), index, weights)
    faulty = "weights = weights * router.per_expert_scale.float()[expert_ids.long()]"
    assert source.count(faulty) == 1
    moved = []
    for name, text in (("good", source), ("fault", source.replace(faulty, "weights = weights"))):
        module = harness.load_generated(text, f"gemma4_{name}")
        ours = module.Gemma4TextScaledRouterSparseMoeBlock(checkpoint_probe.config, harness.infer_config(), None,
                                                           prefix="model.layers.0.moe_block")
        assert ours.load_weights(tensors) == set(dict(ours.named_parameters()))
        ours.process_weights_after_loading()
        with torch.no_grad():
            moved.append(float((ours(x) - want).abs().max() / want.abs().max()))
    assert moved[0] < 1e-5 and moved[1] > 1e-3, moved
    # a config of the family without the branch (enable_moe_block false: no experts) is refused in one line
    dense = copy.deepcopy(checkpoint_probe.config)
    dense.num_experts = None
    with pytest.raises(ValueError, match="config.num_experts is None: this file's layers hold a sparse-MoE branch"):
        module.Gemma4TextScaledRouterSparseMoeBlock(dense, harness.infer_config(), None, prefix="model.layers.0.moe_block")


def _router_without(what: str):
    """Gemma4TextRouter's forward with one step left out: the per_expert_scale, the weightless norm or the scale."""
    import torch

    def forward(self, hidden_states):
        if what != "norm":
            hidden_states = self.norm(hidden_states)
        hidden_states = hidden_states * (self.scale if what != "scale" else 1.0) * self.scalar_root_size
        probabilities = torch.nn.functional.softmax(self.proj(hidden_states), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probabilities, k=self.config.top_k_experts, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if what != "per_expert_scale":
            weights = weights * self.per_expert_scale[index]
        return probabilities, weights, index

    return forward


@pytest.mark.parametrize("what", ["per_expert_scale", "norm", "scale"])
def test_a_router_without_its_norm_or_scales_is_refused(checkpoint_probe, monkeypatch, what):
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.moe_scaled_router import derive_scaled_router

    router_class = type(checkpoint_probe.layers[0].router)
    monkeypatch.setattr(router_class, "forward", _router_without(what))
    with pytest.raises(NotNative, match="routes otherwise than top-k of the softmax"):
        derive_scaled_router(checkpoint_probe)


def test_a_layer_whose_moe_branch_is_not_normed_is_refused(checkpoint_probe, monkeypatch):
    from agent.recipe.native.compose import compose
    from agent.recipe.native.not_native import NotNative

    # the sparse-MoE branch's output norm an identity: the branch's output joins the sum unnormed
    norm_class = type(checkpoint_probe.layers[0].post_feedforward_layernorm_2)
    forward = norm_class.forward
    targets = {id(layer.post_feedforward_layernorm_2) for layer in checkpoint_probe.layers}
    monkeypatch.setattr(norm_class, "forward", lambda self, x: x if id(self) in targets else forward(self, x))
    monkeypatch.delitem(checkpoint_probe.memo, "norm_roles", raising=False)
    with pytest.raises(NotNative) as caught:
        compose(checkpoint_probe)
    assert caught.value.kind == "decoder layer"
    assert "post_feedforward_layernorm_2 is not the norm its other norms are" in caught.value.reason


@pytest.mark.parametrize("stated", [{"attention_k_eq_v": True, "num_global_key_value_heads": 2},
                                    {"per_layer_config": {"5": {"head_dim": 512, "num_key_value_heads": 2}}}])
def test_preflight_splits_the_full_layers_key_heads_too(stated):
    """gemma-4-26B's config.json: 8 key/value heads split 4 ways, its full layers' 2 do not (replicated, 4 % 2 == 0,
    passes); 3 ways, 3 key heads split and 2 do not; the file's check_parallel reads the same per layer (KV_HEADS_PER_LAYER)."""
    from agent.recipe.native.preflight import parallel_problem

    config = {"num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 2112, "vocab_size": 262144,
              **stated}
    assert parallel_problem(config, {"world_size": 4, "attn_tp_size": 4, "lmhead_tp_size": 1}) is None
    assert parallel_problem({**config, "num_key_value_heads": 3, "num_attention_heads": 12},
                            {"world_size": 3, "attn_tp_size": 3, "lmhead_tp_size": 1}).startswith(
        "attn_tp_size over num_global_key_value_heads (replicated)" if "attention_k_eq_v" in stated
        else "attn_tp_size over per_layer_config[5].num_key_value_heads (replicated)")


def test_a_layer_without_v_proj_whose_values_are_not_its_keys_is_refused(checkpoint_probe, monkeypatch):
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_k_eq_v import keys_as_values

    probe = checkpoint_probe
    full = probe.config.layer_types.index("full_attention")
    # values that never reach the output (zeroed after the value norm): not k_proj's output as values
    monkeypatch.setattr(probe.layers[full].self_attn.v_norm, "forward", lambda x: torch.zeros_like(x))
    monkeypatch.delitem(probe.memo, "keys_as_values", raising=False)
    with pytest.raises(NotNative, match="its values are not its k_proj's output"):
        keys_as_values(probe)
    assert probe.layers[full].self_attn.v_proj is None        # the probe's model left as it was


def test_a_value_norm_with_a_weight_or_another_formula_is_refused():
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention import value_norm

    config = type("Config", (), {"rms_norm_eps": 1e-6})()
    assert value_norm(None, 8, config) is False

    class Weightless(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    class MeanCentred(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:])

    assert value_norm(Weightless(), 8, config) is True
    with pytest.raises(NotNative, match="not an RMSNorm without a weight"):
        value_norm(MeanCentred(), 8, config)
    with pytest.raises(NotNative, match="has a weight"):
        value_norm(torch.nn.RMSNorm(8), 8, config)


def test_the_layer_scalar_multiplies_the_whole_output(gemma4_probe, monkeypatch):
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.block import block_roles, layer_scalar

    probe = gemma4_probe
    roles = block_roles(probe)
    assert layer_scalar(probe, roles) == {"LAYER_SCALAR": True}
    layer = probe.layers[0]
    forward = layer.forward
    # a layer whose scalar leaves its output as it was: refused, not written as scaled
    monkeypatch.setattr(layer, "forward", lambda *args, **kwargs: forward(*args, **kwargs) / layer.layer_scalar)
    with pytest.raises(NotNative, match="does not multiply its output"):
        layer_scalar(probe, roles)
    assert float(layer.layer_scalar) == 1.0         # the probe's model left as it was


@pytest.mark.slow
def test_the_file_matches_transformers_and_the_faults_fail(tmp_path):
    """Slow: the stand-in self-check of every setting and three faults is over the default suite's budget.
    Default-suite coverage of the same path: the readings that write it (the tests above); the per-step self-check
    of gemma4's files is scripts/native_coverage.py."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from part_selfcheck import selfcheck_with_faults

    config = AutoConfig.for_model("gemma4_text", **NO_PLE).to_dict()
    composition = derive(config)
    assert composition.options["HEAD_DIM_PER_LAYER"] and composition.options["V_NORM"]
    assert composition.options["LAYER_SCALAR"]
    selfcheck_with_faults({"gemma4_text": (config, composition)}, {"gemma4_text": FAULTS}, "NativeForCausalLM",
                          tmp_path, keep=lambda label: True)


@pytest.mark.slow
def test_the_26b_shape_without_its_moe_matches_transformers_and_the_faults_fail(tmp_path):
    """Slow (about 6 minutes on a loaded 2-core host): the stand-in self-check of gemma-4-26B's text shape with its
    MoE keys dropped — the full layers' 1 key head beside 2 (shrunk) and their keys as values — in float32,
    bfloat16 and each family setting (attention_k_eq_v off among them), and two faults: every layer built with the
    first layer's key heads, and the full layers' value rows left unloaded. Default-suite coverage of the same path:
    test_key_heads_per_layer_and_keys_as_values_are_read (the readings that write it)."""
    from agent.recipe.native.compose import derive
    from agent.testing.checkpoint_shapes import checkpoint_config
    from part_selfcheck import selfcheck_with_faults

    config, _ = checkpoint_config("gemma4_text")
    config = {key: value for key, value in config.items() if key not in DENSE_26B_DROPPED}
    composition = derive(config)
    assert composition.options["KV_HEADS_PER_LAYER"] and composition.options["K_EQ_V"]
    assert ("attention_k_eq_v off", {"attention_k_eq_v": False}) in composition.checked_variants
    selfcheck_with_faults({"gemma4_text": (config, composition)}, {"gemma4_text": DENSE_26B_FAULTS},
                          "NativeForCausalLM", tmp_path, keep=lambda label: True)


@pytest.mark.slow
def test_the_26b_shape_with_its_moe_branch_matches_transformers_and_the_faults_fail(tmp_path):
    """Slow (minutes on a loaded 2-core host): the stand-in self-check of gemma-4-26B's text shape as it is — its
    sparse-MoE branch beside the dense MLP — in float32, bfloat16 and each family setting, and the branch's faults
    (MOE_26B_FAULTS). Default-suite coverage of the same path: test_the_checkpoints_moe_branch_beside_the_dense_mlp_is_read
    and the refusals after it (the readings that write it)."""
    from agent.recipe.native.compose import derive
    from agent.testing.checkpoint_shapes import checkpoint_config
    from part_selfcheck import selfcheck_with_faults

    config, _ = checkpoint_config("gemma4_text")
    composition = derive(config)
    assert composition.parts["block"] == "sandwich_moe_beside_mlp"
    selfcheck_with_faults({"gemma4_text": (config, composition)}, {"gemma4_text": MOE_26B_FAULTS},
                          "NativeForCausalLM", tmp_path, keep=lambda label: True)
