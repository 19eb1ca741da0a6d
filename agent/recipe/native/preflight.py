"""Before a native framework model runs: its heads and widths split evenly at the YAML's tensor-parallel
sizes (module.linear's layers divide them), or one line saying which does not, before anything runs.
The same rule as the generated file's own `check_parallel` (templates/framework/native/modeling.py.j2)."""

from __future__ import annotations

from pathlib import Path

from engine.safe_load import load_json


def is_native(recipe_path: Path) -> bool:
    """A framework recipe whose model is the native modeling_NAME.py (not the adapter around vendored code)."""
    name = recipe_path.name
    model = recipe_path / "models" / f"modeling_{name}.py"
    return not (recipe_path / "models" / f"modeling_{name}_framework.py").exists() and model.is_file() \
        and "def check_parallel(" in model.read_text(errors="replace")


def parallel_problem(config: dict, parallel: dict) -> str | None:
    """Which head count or width does not divide at parallel_config's attn_tp_size / lmhead_tp_size (an
    MoE model's expert widths: at moe_tp_size)."""
    config = config.get("text_config") or config
    attn = int(parallel.get("attn_tp_size") or 1)
    lmhead = int(parallel.get("lmhead_tp_size") or 1)
    moe = int(parallel.get("moe_tp_size") or 1)
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    tp = "tensor-parallel size"
    checks = [("num_attention_heads", heads, attn, tp), ("intermediate_size", config.get("intermediate_size"), attn, tp),
              ("vocab_size", config.get("vocab_size"), lmhead, tp)]
    if any(isinstance(config.get(k), int) and config[k] > 1 for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")):
        # the routed and shared experts' intermediate axis splits over moe_tp_size
        widths = ("moe_intermediate_size", "shared_expert_intermediate_size") if config.get("moe_intermediate_size") \
            else ("intermediate_size",)
        checks += [(key, config.get(key), moe, "moe_tp_size") for key in widths]
    if config.get("kv_lora_rank"):
        pass                 # MLA: one latent key / value head, whole on every rank; the query heads split
    elif isinstance(kv_heads, int) and kv_heads >= attn:
        checks.append(("num_key_value_heads", kv_heads, attn, tp))
    elif isinstance(kv_heads, int) and kv_heads and attn % kv_heads:
        checks.append(("attn_tp_size over num_key_value_heads (replicated)", attn, kv_heads, tp))
    for what, value, size, kind in checks:
        if isinstance(value, int) and size > 1 and value % size:
            return f"{what} {value} does not divide by parallel_config's {kind} {size}: choose a size that divides it"
    return None


def check(recipe_path: Path, checkpoint: Path | None, settings: dict, yaml_name: str) -> None:
    from agent.errors import InputError

    if checkpoint is None or not is_native(recipe_path):
        return
    parallel = settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}
    try:
        config = load_json(Path(checkpoint) / "config.json")
    except (OSError, ValueError):
        return
    problem = parallel_problem(config if isinstance(config, dict) else {}, parallel)
    if problem:
        raise InputError(f"{yaml_name}: {problem}")
