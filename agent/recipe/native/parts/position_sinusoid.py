"""Fixed sinusoid positions held by the base model as a buffer (ctrl's `pos_encoding`), not a module: the rows the
embedding (agent.recipe.native.parts.embedding: probe.memo["position_buffer"]) found added before the first layer,
held to Vaswani et al.'s table as transformers' CTRL builds it — position x 10000^(-2 (i // 2) / width), sin of the
even columns then cos of the odd ones. The file computes the same table (code/position_sinusoid.py) and adds its
rows to the embedding as the absolute-position skeleton does; no rotary in the attention."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.embedding import embed_scale
from agent.recipe.native.parts.part import Match, Part


def ctrl_sinusoids(rows: int, width: int):
    """transformers' CTRL positional_encoding (the code file's ctrl_sinusoid_table), float32."""
    import torch

    columns = torch.arange(width, dtype=torch.int64).float().unsqueeze(0)
    angles = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * (1 / torch.pow(10000, (2 * (columns // 2))
                                                                                         / width))
    return torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=-1)


def _probe(probe, chosen):
    import torch

    if "position_offset" not in probe.memo:
        embed_scale(probe)
    name = probe.memo.get("position_buffer")
    if name is None:
        return None
    buffer = getattr(probe.base, name).detach().float()
    if not torch.allclose(buffer, ctrl_sinusoids(*buffer.shape), rtol=1e-5, atol=1e-5):
        raise NotNative("position", f"positions added from the base model's buffer {name}, whose rows are not "
                                    "CTRL's sinusoids (sin | cos of position x 10000^(-2 (i // 2) / width))")
    if buffer.shape[0] != probe.config.max_position_embeddings:
        raise NotNative("position", f"the buffer {name} holds {buffer.shape[0]} positions, not the config's "
                                    f"max_position_embeddings ({probe.config.max_position_embeddings})")
    return Match(SINUSOID_BUFFER_POSITIONS, options={"ABSOLUTE_POSITIONS": True}, facts={"buffer": name})


SINUSOID_BUFFER_POSITIONS = Part(
    slot="position", name="sinusoid_buffer_positions", code="position_sinusoid.py",
    provides="ModelSinusoidPositionEmbedding", reads=("max_position_embeddings", "hidden_size"), probe=_probe,
    options=("ABSOLUTE_POSITIONS",),
    kernels=lambda m: ((), ("fixed sinusoid position rows (CTRL's): a plain torch lookup added to the embedding",)))
