"""Readings of issue 46's layouts that move a type's fall-back to its true next blocker: a weightless module soft-capping
the logits (inkling2's logit_softcap: parts/head.py final_softcaps, the head part's FINAL_SOFTCAP), positions added
from a buffer of the base model (ctrl's pos_encoding: parts/embedding.py added_buffer), the embedding normalised by the
weightless final norm (nanochat: EMBED_FINAL_NORM; its file's self-check is test_part_layouts_46.py's), an MLP held as
a Sequential (ctrl's ffn: parts/layout.py). The readings are checked on small modules in-process with a fault each (the
cap, the rows, the norm); the types' derives, which name their next blockers, are slow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _softcap_probe(cap: float, module):
    import torch

    model = torch.nn.Module()
    model.model, model.lm_head, model.logit_softcap = torch.nn.Identity(), torch.nn.Linear(4, 4), module
    return SimpleNamespace(config=SimpleNamespace(final_logit_softcapping=cap), model=model)


def softcap(cap: float):
    """A weightless module c * tanh(x / c), as inkling2's Inkling2Softcap."""
    import torch

    class Softcap(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x / cap) * cap

    return Softcap()


def test_a_logit_softcap_module_is_the_heads_final_softcap_and_another_cap_is_not():
    from agent.recipe.native.parts.head import final_softcaps

    assert final_softcaps(_softcap_probe(30.0, softcap(30.0))) == {"logit_softcap"}
    assert final_softcaps(_softcap_probe(30.0, softcap(15.0))) == set()        # the fault: another cap
    assert final_softcaps(_softcap_probe(None, softcap(30.0))) == set()        # no cap in the config


def test_positions_from_a_base_buffer_are_named_and_other_rows_are_not():
    import torch

    from agent.recipe.native.parts.embedding import added_buffer

    hidden, gen = 8, torch.Generator().manual_seed(0)
    base = torch.nn.Module()
    base.register_buffer("pos_encoding", torch.randn(16, hidden, generator=gen), persistent=False)
    table = torch.randn(3, hidden, generator=gen)
    probe = SimpleNamespace(base=base, hidden=hidden)
    got = table * hidden ** 0.5 + base.pos_encoding[:3]
    assert added_buffer(probe, got, table) == "pos_encoding"
    assert added_buffer(probe, table * hidden ** 0.5 + base.pos_encoding[1:4], table) is None   # the fault: rows 1..


def test_the_embedding_through_the_weightless_final_norm_is_read_and_a_weighted_norm_is_not():
    """nanochat's base model normalises the embedding by its final norm (no weight) before the first layer; llama's
    final norm has a weight and its first layer takes the embedding itself."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.embedding import embed_scale
    from agent.recipe.native.parts.probe import Probe

    nanochat = Probe(AutoConfig.for_model("nanochat").to_dict())
    assert embed_scale(nanochat) is False and nanochat.memo.get("embed_final_norm") is True
    llama = Probe(AutoConfig.for_model("llama").to_dict())
    assert embed_scale(llama) is False and "embed_final_norm" not in llama.memo


@pytest.mark.slow
@pytest.mark.parametrize("model_type, kind, reason", [
    ("inkling2_text", "model", "final_input"),
])
def test_the_types_fall_back_naming_their_next_blocker(model_type, kind, reason):
    """Slow (each type's derive): the default cases of these readings are the module tests above."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative) as refused:
        derive(AutoConfig.for_model(model_type).to_dict())
    assert refused.value.kind == kind and reason in str(refused.value)


@pytest.mark.slow
def test_ctrls_sequential_mlp_is_read_as_the_layers_mlp():
    """Slow (ctrl's probe): its ffn (Linear, ReLU, Linear) is the layer's mlp, its linears up_proj / down_proj."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.layout import mlp_roles
    from agent.recipe.native.parts.probe import Probe, children

    probe = Probe(AutoConfig.for_model("ctrl").to_dict())
    mlp = children(probe.layers[0])["mlp"]
    assert mlp_roles(mlp) == {"up_proj": "0", "act_fn": "1", "down_proj": "2"}
