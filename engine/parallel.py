"""Tensor parallel over groups of attn_tp_size consecutive ranks, data parallel over the groups.

The plan is the model's own: `base_model_tp_plan` of its configuration class (vendored with the
model), read in one place (`tp_plan`); transformers shards the weights by it while loading, each
rank reading only its slices from the checkpoint. torch.distributed underneath: hccl, nccl or gloo
by device. The size rules live in engine.config.check_parallel.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.environment import device_module


def tp_plan(config) -> dict | None:
    """The model's tensor-parallel plan: `base_model_tp_plan` of its configuration (an instance or
    the class), or of its text sub-configuration for a composite one; None: it has none."""
    candidates = []
    if isinstance(config, type):
        candidates.append(config)
        sub = getattr(config, "sub_configs", None) or {}
        candidates.extend(sub[key] for key in ("text_config", *sub) if key in sub)
    else:
        if hasattr(config, "get_text_config"):
            candidates.append(config.get_text_config())
        candidates.append(config)
    for candidate in candidates:
        plan = getattr(candidate, "base_model_tp_plan", None)
        if plan:
            return dict(plan)
    return None


def families_with_tp_plan() -> list[str]:
    """model_types whose transformers configuration class declares a tensor-parallel plan (read from
    the configuration modules' source: importing all of them takes half a minute)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    models_dir = Path(transformers.__file__).parent / "models"
    declares = re.compile(r"^\s+base_model_tp_plan\s*=\s*\{", re.M)
    names = []
    for model_type in CONFIG_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        source = models_dir / module / f"configuration_{module}.py"
        if source.is_file() and declares.search(source.read_text(encoding="utf-8", errors="replace")):
            names.append(model_type)
    return sorted(names)


def no_plan_error(config, what: str) -> ValueError:
    import transformers

    families = families_with_tp_plan()
    return ValueError(
        f"{what}: {getattr(config, 'model_type', getattr(config, '__name__', 'this model'))} has no tensor-parallel "
        f"plan in transformers {transformers.__version__}; set attn_tp_size: 1 (world_size then splits the batch "
        f"only). Families with a plan ({len(families)}): {', '.join(families)}")


def init_distributed(torch, device, local_rank: int):
    """torchrun started this rank: one device per rank, hccl / nccl / gloo by device."""
    import torch.distributed as dist

    devices = device_module(device.type)
    if devices is not None:
        device = torch.device(device.type, local_rank)
        devices.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend={"npu": "hccl", "cuda": "nccl"}.get(device.type, "gloo"))
    return device


def tensor_parallel_config(model_cls, config, tp: int, dp: int, moe_tp: int, lmhead_tp: int):
    """transformers' DistributedConfig for attn_tp_size-way tensor parallel within each of `dp` replicas.
    moe_tp_size 1 keeps the experts whole on every rank; lmhead_tp_size 1 keeps lm_head whole."""
    from transformers.distributed import DistributedConfig

    plan = tp_plan(config)
    if not plan:
        raise no_plan_error(config, f"parallel_config.attn_tp_size={tp}")
    prefix = f"{model_cls.base_model_prefix}." if getattr(model_cls, "base_model_prefix", "") else ""
    overrides = {}
    if moe_tp == 1:
        overrides.update({prefix + key: "replicate" for key in plan if ".experts" in key})
    if lmhead_tp == 1:
        # Vocabulary whole on every rank: lm_head and the input embeddings (often the same tensor).
        if "lm_head" in (getattr(model_cls, "_tp_plan", None) or {}):
            overrides["lm_head"] = "replicate"
        overrides[prefix + "embed_tokens"] = "replicate"

    class TensorParallelReplicas(DistributedConfig):
        """dp_replicate_size groups of tp ranks, each a whole (sharded) model: replicas, not FSDP."""

        @property
        def dp_size(self) -> int:
            return 1

    return TensorParallelReplicas(tp_size=tp, dp_replicate_size=dp, tp_plan=overrides or "auto")


def check_tied_lm_head(model) -> None:
    """lm_head tied to whole (unsharded) input embeddings must not be hooked as a sharded layer.

    Its forward would take the whole vocabulary for this rank's shard, all-gather world x vocab
    logits and fail with "narrow unexpectedly changed concrete size on dim 2: 2V -> V". transformers
    shards the embeddings (vocabulary rows) whenever the model's plan is applied and the base
    model's `embed_tokens` is an nn.Embedding; a plan or model where that does not hold needs
    lmhead_tp_size: 1.
    """
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return
    style = (getattr(model, "tp_plan", None) or {}).get("lm_head", "replicate")
    sharded = any(p.is_shard() for p in getattr(out.weight, "placements", ()))
    if style != "replicate" and not sharded:
        raise RuntimeError(
            f"lm_head is tied to the input embeddings, which this tensor-parallel plan leaves whole, but the "
            f"plan shards lm_head ({style}); set parallel_config.lmhead_tp_size: 1")
