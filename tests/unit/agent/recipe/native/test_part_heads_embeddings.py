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
    # the default case: test_moe_features.py's test_a_router_scoring_more_experts_than_the_block_routes_to_is_not_native
    ("inkling_text", "moe", "the router scores 258 experts and the block routes to 256; config.n_shared_experts is 2"),
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


def _lm(prefix: str, base, **heads):
    """A causal LM of toy modules: the base model under `prefix`, `heads` beside it, the output embedding the
    Linear named by the `output` path."""
    import torch

    output = heads.pop("output")

    class LM(torch.nn.Module):
        base_model_prefix = prefix

        def get_output_embeddings(self):
            return self.get_submodule(output)

    model = LM()
    setattr(model, prefix, base)
    for name, module in heads.items():
        setattr(model, name, module)
    return model


def test_heads_besides_lm_head_are_named_with_where_the_logits_come_from():
    """modernbert-decoder's lm_head is a transform (dense, act, norm) before its output embedding `decoder`; xlm's
    output embedding is pred_layer.proj, beside its base model under transformer: each line names them."""
    import torch

    from agent.recipe.native.parts.model import heads_text

    class PredictionHead(torch.nn.Sequential):
        pass

    modernbert = _lm("model", torch.nn.Identity(), lm_head=PredictionHead(torch.nn.Linear(4, 4)),
                     decoder=torch.nn.Linear(4, 9), output="decoder")
    assert heads_text(modernbert, {"decoder"}) == ("heads other than lm_head: decoder (Linear); the logits from "
                                                   "decoder after lm_head (PredictionHead)")
    pred_layer = torch.nn.Module()
    pred_layer.proj = torch.nn.Linear(4, 9)
    xlm = _lm("transformer", torch.nn.Identity(), pred_layer=pred_layer, output="pred_layer.proj")
    assert heads_text(xlm, {"pred_layer", "transformer"}) == (
        "heads other than lm_head: pred_layer (Module) beside the base model under transformer; the logits from "
        "pred_layer.proj")


@pytest.mark.parametrize("causal", [True, False])
def test_logits_that_follow_a_later_token_are_refused_as_not_causal(causal):
    """The model part's causality reading (xlm's causal false, xlnet's attn_type bi): a toy LM whose logits at a
    token sum the embeddings up to it passes, one that sums the whole sequence's is refused."""
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.model import refuse_non_causal

    embed = torch.nn.Embedding(16, 4)

    class LM(torch.nn.Module):
        def forward(self, input_ids):
            h = embed(input_ids)
            mixed = h.cumsum(1) if causal else h.sum(1, keepdim=True).expand_as(h)
            return SimpleNamespace(logits=mixed @ embed.weight.T)

    probe = SimpleNamespace(config=SimpleNamespace(vocab_size=16), model=LM())
    if causal:
        refuse_non_causal(probe)
    else:
        with pytest.raises(NotNative, match="follow a later token: the attention is not causal"):
            refuse_non_causal(probe)
