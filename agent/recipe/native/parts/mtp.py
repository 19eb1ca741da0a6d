"""The multi-token-prediction draft (code/mtp.py), as upstream's models/deepseek_r1 writes it: where the
checkpoint's config says it ships MTP layers (`num_nextn_predict_layers`, stored as model.layers.{num_hidden_layers}.*)
and the architecture is one whose MTP layer upstream / vLLM build as one more decoder layer of the model's own kind
(DeepSeek-V3's and GLM-4.5's: enorm, hnorm, eh_proj, shared_head.norm around it; embed_tokens and the head shared
with the main model). model_config.next_n > 0 runs it; at 0 the file runs as one without it and its loader skips
those tensors by name."""

from __future__ import annotations

from agent.recipe.native.parts.part import Match, Part

# model types whose MTP layer is a decoder layer of the main model's kind behind enorm / hnorm / eh_proj
# (vLLM's deepseek_mtp.py and glm4_moe_mtp.py, upstream's deepseek_r1)
MTP_MODEL_TYPES = frozenset({"deepseek_v3", "glm4_moe"})


def _probe(probe, chosen):
    layers = getattr(probe.full_config, "num_nextn_predict_layers", None) or 0
    if not layers or probe.model_type not in MTP_MODEL_TYPES:
        return None
    return Match(MTP, options={"MTP": True}, facts={"layers": layers})


MTP = Part(
    slot="mtp", name="mtp_draft", code="mtp.py", provides="ModelModelMTP",
    reads=("num_nextn_predict_layers", "num_hidden_layers", "hidden_size", "rms_norm_eps"), probe=_probe,
    options=("MTP",),
    kernels=lambda m: (("MTP draft (next_n): its decoder layer's kernels, npu_rms_norm for enorm / hnorm / "
                        "shared_head.norm; the verified window of next_n + 1 tokens through the decode attention "
                        "with sparse_mode 3",), ()))
