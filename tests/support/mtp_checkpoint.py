"""An MTP layer added to a tiny checkpoint as DeepSeek-V3 / GLM-4.5 store theirs (model.layers.{num_hidden_layers}.*:
enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens, and one decoder layer).

`draft="copy"`: a draft whose guess is the main model's own prediction for the token it is given (eh_proj keeps
the hnorm'd hidden state, the decoder layer adds nothing: o_proj and the MLP's down projections zero), i.e. "the
next token repeats this one" — a tiny random model's greedy text repeats itself, so most drafts are accepted.
`draft="wrong"`: the same with eh_proj's sign flipped (a wrong MTP weight): it drafts the least likely token.

`repetitive(checkpoint)`: a checkpoint whose greedy text mostly repeats its last token (the embedding x8, the
lm_head rows equal to the embedding's): a text with repeats and changes, so drafts are both accepted and
rejected."""

from __future__ import annotations

import json
from pathlib import Path


def add_mtp_layer(checkpoint: Path, draft: str = "copy") -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden = config["hidden_size"]
    files = sorted(checkpoint.glob("*.safetensors"))
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    layer = f"model.layers.{last}."
    added = {}
    for name, tensor in tensors.items():
        if name.startswith(layer):
            rest = name[len(layer):]
            value = tensor.clone()
            if rest.endswith("o_proj.weight") or "down_proj" in rest:
                value.zero_()
            added[f"model.layers.{mtp}.{rest}"] = value
    dtype = tensors["model.embed_tokens.weight"].dtype
    eye = torch.eye(hidden, dtype=dtype)
    zero = torch.zeros(hidden, hidden, dtype=dtype)
    halves = (zero, eye if draft == "copy" else -eye)
    added.update({
        f"model.layers.{mtp}.enorm.weight": torch.ones(hidden, dtype=dtype),
        f"model.layers.{mtp}.hnorm.weight": torch.ones(hidden, dtype=dtype),
        f"model.layers.{mtp}.eh_proj.weight": torch.cat(halves, dim=1).contiguous(),
        f"model.layers.{mtp}.shared_head.norm.weight": torch.ones(hidden, dtype=dtype),
        f"model.layers.{mtp}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        f"model.layers.{mtp}.shared_head.head.weight": tensors.get("lm_head.weight",
                                                                  tensors["model.embed_tokens.weight"]).clone(),
    })
    save_file(added, str(checkpoint / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "model-mtp.safetensors" for name in added})
        index.write_text(json.dumps(data, indent=2))
    config["num_nextn_predict_layers"] = 1
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    return checkpoint


def repetitive(checkpoint: Path, scale: float = 8.0) -> Path:
    from safetensors.torch import load_file, save_file

    path = Path(checkpoint) / "model.safetensors"
    tensors = load_file(str(path))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = (embed * scale).contiguous()
    if "lm_head.weight" in tensors:
        tensors["lm_head.weight"] = embed.clone().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(checkpoint)
