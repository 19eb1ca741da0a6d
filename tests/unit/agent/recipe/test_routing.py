"""agent/recipe/routing.py, the family table: a family is picked from config features, never from a model's name;
every route names a family row and every row has its template."""

from __future__ import annotations


def test_routing_table_detects_families_from_config_features():
    from agent.recipe.routing import FAMILIES, ROUTES, route

    assert route({"model_type": "brand_new", "kv_lora_rank": 512, "n_routed_experts": 64}).name == "mla"
    assert route({"model_type": "brand_new", "num_local_experts": 8}).name == "moe"
    assert route({"model_type": "brand_new", "num_experts": 1}).name == "standard"
    assert route({"layer_types": ["sliding_attention", "full_attention"]}).name == "sliding_window"
    assert route({"sliding_window": 4096, "use_sliding_window": False}).name == "standard"
    assert route({"hidden_size": 64}).name == "standard"
    assert route({"layer_types": ["linear_attention", "full_attention"], "num_experts": 8}).name == "hybrid_recurrent"
    assert route({"mamba_d_state": 16, "attn_layer_period": 8}).name == "hybrid_recurrent"
    # Every route names a family row and every family row has a template.
    from agent.paths import templates_dir

    assert {name for name, _ in ROUTES} == set(FAMILIES)
    assert all((templates_dir() / fam.runner_template).is_file() for fam in FAMILIES.values())
