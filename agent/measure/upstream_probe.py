"""Inside an upstream recipe's process: record what its model computed on its prefills.

Installed by `_upstream_probe/sitecustomize.py` when MIGRATOR_UPSTREAM_PROBE names a file; imports
torch only (this file runs in the recipe's process, not the migrator's). A global forward pre-hook
waits for the first call of a `*ForCausalLM` module, then hooks its decoder layers (the ModuleList
of `config.num_hidden_layers` modules) and itself: on rank 0, each prefill call (more than one token
per request) leaves its input ids, the logits it returned and every layer's output hidden states
(a layer that returns `(residual, hidden)` is their sum, the stream the next layer reads) in the
file, as {"prefills": [...]} (torch.save). Decode calls and compiled regions are not touched.
"""

from __future__ import annotations

import os

MAX_PREFILLS = 4
MAX_TOKENS = 1024

_state = {"path": None, "models": set(), "prefills": [], "layers": {}, "current": None}


def install(path: str) -> None:
    import torch

    _state["path"] = path
    torch.nn.modules.module.register_module_forward_pre_hook(_find_model)


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _compiling() -> bool:
    import torch

    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


def _find_model(module, args):
    if _compiling() or id(module) in _state["models"] or not type(module).__name__.endswith("ForCausalLM"):
        return None
    _state["models"].add(id(module))
    if _rank() != 0:
        return None
    import torch

    config = getattr(module, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    layers = None
    for _, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and count and len(child) == count:
            layers = child
            break
    if layers is not None:
        for index, layer in enumerate(layers):
            layer.register_forward_hook(_layer_hook(index))
    module.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)
    module.register_forward_hook(_model_hook, with_kwargs=True)
    return None


def _input_ids(args, kwargs):
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    return ids


def _model_pre_hook(module, args, kwargs):
    if _compiling():
        return None
    ids = _input_ids(args, kwargs)
    prefill = ids is not None and hasattr(ids, "numel") and ids.numel() > 1
    metadata = kwargs.get("forward_metadata")
    if metadata is not None and hasattr(metadata, "is_prefill"):
        prefill = bool(metadata.is_prefill)
    if prefill and len(_state["prefills"]) < MAX_PREFILLS:
        _state["current"] = {"input_ids": ids.detach().reshape(-1)[:MAX_TOKENS].cpu().clone(), "layers": {}}
    else:
        _state["current"] = None
    return None


def _hidden(output):
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
        if len(tensors) == 2 and tensors[0].shape == tensors[1].shape:
            return tensors[0].float() + tensors[1].float()
        if tensors:
            return tensors[0]
    return None


def _layer_hook(index):
    def hook(module, args, output):
        current = _state["current"]
        if current is None or _compiling():
            return None
        hidden = _hidden(output)
        if hidden is not None:
            flat = hidden.detach().float().reshape(-1, hidden.shape[-1])
            current["layers"][index] = flat[:MAX_TOKENS].cpu().clone()
        return None
    return hook


def _model_hook(module, args, kwargs, output):
    import torch

    current = _state["current"]
    _state["current"] = None
    if current is None or _compiling():
        return None
    logits = _hidden(output)
    if logits is None:
        return None
    current["logits"] = logits.detach().float().reshape(-1, logits.shape[-1]).cpu().clone()
    current["layers"] = [current["layers"][i] for i in sorted(current["layers"])]
    _state["prefills"].append(current)
    tmp = _state["path"] + ".tmp"
    torch.save({"prefills": _state["prefills"], "model": type(module).__name__}, tmp)
    os.replace(tmp, _state["path"])
    return None
