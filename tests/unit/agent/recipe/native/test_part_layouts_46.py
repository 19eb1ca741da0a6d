"""Issue 46's layouts written natively. Falcon: its key/value heads as its config gives them (probe.key_value_heads,
MULTI_QUERY in parts/code/attention_fused.py: num_kv_heads, one where multi_query outside the new decoder
architecture), its fused query_key_value in each layout (falcon-7b's [q; k; v] of one key head, the new architecture's
per-key-group [q..q k v], the other old one's per-head [q k v]: parts/attention.py QKV_GROUPS), its layers (the
parallel one-norm layer, the new architecture's parallel layer on ln_attn / ln_mlp: parts/layout.py and
parts/block_parallel.py, the sequential pre-norm one) and its MLP width (ffn_hidden_size). nanochat: RMSNorms without
weight (parts/norm_weightless_rms.py, its q/k norms too), the rotary by the negative angle (ROTATE_BACKWARD in
parts/code/rotary.py), the embedding through the final norm (EMBED_FINAL_NORM). Each held to transformers in float32
and bfloat16 and on its family settings but the rope types; a file with the part's arithmetic broken fails the same
check. The default case self-checks falcon-7b's file (one key/value head of 71 query heads, the parallel layer) with one
fault (the key/value heads' rule), nanochat's and ctrl's (CTRL's sinusoid table from the base model's buffer, its
Wq / Wk / Wv / dense attention and Sequential ffn), in one stand-in process; the others are slow. falcon's ALiBi
(config.alibi) falls back naming it."""

from __future__ import annotations

import functools

import pytest

# name: (config keys over transformers' falcon defaults, parts expected, options expected, faults)
VARIANTS = {
    # falcon-40b / 180B's shape (heads and widths the probe shrinks): grouped [q..q k v] per key head, two norms
    "falcon_new": ({"new_decoder_architecture": True, "num_attention_heads": 128, "num_kv_heads": 8,
                    "hidden_size": 8192},
                   {"block": "parallel_two_norms", "attention": "fused_paged", "mlp": "plain_mlp", "norm": "layer_norm"},
                   {"QKV_GROUPS": ("kv_heads", "qkv"), "MULTI_QUERY": True, "MLP_NORM": True, "PARALLEL_KEY": None},
                   [("hidden_states = self.post_attention_layernorm(residual)",
                     "hidden_states = self.input_layernorm(residual)")]),
    # falcon-7b's (transformers' defaults): one key/value head, one norm before both branches
    "falcon": ({},
               {"block": "parallel", "attention": "fused_paged", "position": "rotary", "mlp": "plain_mlp"},
               {"MULTI_QUERY": True, "MLP_WIDTH": "ffn_hidden_size"},
               [("return 1 if config.multi_query and not config.new_decoder_architecture else config.num_kv_heads",
                 "return 2 if config.multi_query and not config.new_decoder_architecture else config.num_kv_heads")]),
    # the old architecture without multi_query, rotary: per-head [q k v], sequential pre-norm layers, biases
    "falcon_mha": ({"multi_query": False, "parallel_attn": False, "bias": True, "num_attention_heads": 32,
                    "hidden_size": 2048},
                   {"block": "pre_norm", "attention": "fused_paged"},
                   {"QKV_GROUPS": ("kv_heads", "qkv"), "MULTI_QUERY": True, "QKV_BIAS": True},
                   [('for name in "qkv"])', 'for name in "qvk"])')]),
    # nanochat's (transformers' defaults)
    "nanochat": ({},
                 {"norm": "weightless_rms_norm", "position": "rotary", "attention": "fused_paged", "block": "pre_norm"},
                 {"ROTATE_BACKWARD": True, "EMBED_FINAL_NORM": True, "QK_NORM": True, "FINAL_SOFTCAP": True},
                 [("        self.sin_cached.neg_()\n", "        self.sin_cached.mul_(1.0)\n"),
                  ("        hidden_states = self.norm(hidden_states)\n", "")]),
    # ctrl's (transformers' defaults): CTRL's sinusoids from the base model's buffer (parts/position_sinusoid.py),
    # Wq / Wk / Wv / dense, the Sequential ffn of width dff; faults: the table's sin / cos halves swapped, its rates
    "ctrl": ({},
             {"position": "sinusoid_buffer_positions", "attention": "fused_paged", "mlp": "plain_mlp",
              "block": "pre_norm"},
             {"ABSOLUTE_POSITIONS": True, "MLP_WIDTH": "dff", "ACT_FIXED": "relu", "EMBED_SCALE": True},
             [("torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=-1)",
               "torch.cat([torch.cos(angles[:, 1::2]), torch.sin(angles[:, 0::2])], dim=-1)"),
              ("(2 * (columns // 2))", "(columns // 2)")]),
}
FAST = ("falcon", "nanochat", "ctrl")
MODEL_TYPE = {"falcon": "falcon", "falcon_new": "falcon", "falcon_mha": "falcon", "nanochat": "nanochat",
              "ctrl": "ctrl"}


@functools.lru_cache(maxsize=None)
def derived(name: str):
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model(MODEL_TYPE[name], **VARIANTS[name][0]).to_dict()
    return config, derive(config)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in VARIANTS])
def test_the_parts_are_read_from_the_architecture(name):
    """Slow but the default case's (its derive is the self-check's): the others' derives take seconds each."""
    _, parts, options, _ = VARIANTS[name]
    composition = derived(name)[1]
    assert {slot: composition.parts.get(slot) for slot in parts} == parts, composition.parts
    assert {k: composition.options.get(k) for k in options} == options


@pytest.mark.parametrize("keys, want", [({}, 1), ({"multi_query": False}, 8), ({"multi_query": False, "num_kv_heads": 4}, 4),
                                        ({"new_decoder_architecture": True, "num_kv_heads": 2}, 2),
                                        ({"new_decoder_architecture": True, "multi_query": True, "num_kv_heads": 2}, 2)])
def test_the_key_value_heads_are_falcons_rule(keys, want):
    """probe.key_value_heads and the file's key_value_heads give transformers' attention's count (its num_kv_heads:
    one for multi_query in the old architecture although config.num_kv_heads says as many as the query heads)."""
    from transformers import AutoConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from agent.recipe.native.parts.probe import key_value_heads, multi_query

    config = AutoConfig.for_model("falcon", hidden_size=64, num_attention_heads=8, **keys)
    assert multi_query(config) and not multi_query(AutoConfig.for_model("llama"))
    assert key_value_heads(config) == file_key_value_heads()(config) == FalconAttention(config, 0).num_kv_heads == want


def file_key_value_heads():
    """The code file's key_value_heads, compiled alone (the file imports torch_npu: the stand-in's)."""
    import ast
    from pathlib import Path

    import agent.recipe.native.parts.code as code

    tree = ast.parse((Path(code.__file__).parent / "attention_fused.py").read_text())
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "key_value_heads"]
    namespace: dict = {}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "attention_fused.py", "exec"), namespace)
    return namespace["key_value_heads"]


def test_falcons_alibi_falls_back_naming_it():
    """config.alibi: the position is ALiBi (not the rotary table the model still builds), which the file does not
    compute in falcon's form: the reason names it."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative, match="config.alibi"):
        derive(AutoConfig.for_model("falcon", alibi=True, multi_query=False, parallel_attn=False).to_dict())


def _check(names, tmp_path, faults=None):
    from part_selfcheck import selfcheck_with_faults

    faults = faults if faults is not None else {name: VARIANTS[name][3] for name in names}
    rows = selfcheck_with_faults({name: derived(name) for name in names}, faults, "NativeForCausalLM", tmp_path)
    assert {name for name, label, ok, _ in rows if ok and "bfloat16" in label} == set(names)


def test_falcon_7b_and_nanochat_match_transformers_and_a_fault_fails(tmp_path):
    """One stand-in process: the three files (ctrl's too) on their family settings, and falcon's key/value heads'
    rule broken."""
    _check(FAST, tmp_path, {"falcon": VARIANTS["falcon"][3]})


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in FAST])
def test_falcons_other_layouts_match_transformers_and_faults_fail(name, tmp_path):
    """Slow: the default case of this path is test_falcon_7b_and_nanochat_match_transformers_and_a_fault_fails (the
    key/value heads' rule, the layout, the parallel layer)."""
    _check((name,), tmp_path)


@pytest.mark.slow
def test_nanochats_faults_fail(tmp_path):
    """Slow: the rotary turned forward and the embedding's norm dropped must fail; the default case of this path is
    test_falcon_7b_and_nanochat_match_transformers_and_a_fault_fails (nanochat's correct file)."""
    from part_selfcheck import selfcheck_with_faults

    rows = selfcheck_with_faults({"nanochat": derived("nanochat")}, {"nanochat": VARIANTS["nanochat"][3]},
                                 "NativeForCausalLM", tmp_path, keep=lambda label: False)
    assert [ok for _, _, ok, _ in rows] == [False, False]


@pytest.mark.slow
def test_ctrls_faults_fail(tmp_path):
    """Slow: CTRL's position table with its sin / cos halves swapped, or fairseq's rates, must fail; the default case
    of this path is test_falcon_7b_and_nanochat_match_transformers_and_a_fault_fails (ctrl's correct file) and
    test_part_position_sinusoid.py's reading of the buffer."""
    from part_selfcheck import selfcheck_with_faults

    rows = selfcheck_with_faults({"ctrl": derived("ctrl")}, {"ctrl": VARIANTS["ctrl"][3]}, "NativeForCausalLM",
                                 tmp_path, keep=lambda label: False)
    assert [ok for _, _, ok, _ in rows] == [False, False]
