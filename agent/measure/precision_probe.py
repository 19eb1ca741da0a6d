"""Inside a recipe's process: record what its model computed at every step, for the precision check.

Loaded by `_precision_probe/sitecustomize.py` when MIGRATOR_PRECISION_RECORD names a folder; imports
torch only (this file runs in the recipe's process, not the migrator's: the project's own `models`
folder must not shadow a checkout's). Every rank writes `rank_<R>/call_<N>.pt`, one file per forward
call of the model, so a killed run keeps what it recorded and no file is rewritten:

    {"phase": "prefill" | "decode", "input_ids": 1-D long, "rows": int,
     "seq_ends": cumulative token counts per request (packed prefill) or None,
     "attention_mask": the [B, T] mask of a padded prefill or None,
     "logits": [rows, V] float32 (each request's last position; an MTP decode step, [rows x window, V]: every
               position of each request's window of its token and next_n drafts),
     "window": tokens per request of a decode call (1; next_n + 1 for an MTP step),
     "layers": per decoder layer, its output hidden states [tokens, H] float32 (a layer that returns
               `(residual, hidden)` is their sum: the stream the next layer reads), or None,
     "dtype": the model's parameter dtype}

Where the calls are seen:
* upstream's executor (`executor.core.model_worker.model_worker.ModelWorker.inference`, wrapped when
  that module is imported): every prefill and decode call, eager or compiled (graph mode's decode runs
  a compiled function whose inside no hook sees: its logits are taken from what `inference` returns);
  the warm-up (`forward_metadata.is_warm_up`) and MTP calls are skipped;
* anything else (this tool's engine, a ModelRunner recipe): the first causal-LM module called
  (`is_language_model`: `*ForCausalLM`, `*LMHeadModel` such as GPT-2's, or any class transformers
  generates with), by forward hooks; calls with `use_cache=False` (a full-prompt forward after the run) are skipped.
Decoder layers (the ModuleList of `config.num_hidden_layers` modules) are hooked in both cases; inside
a compiled region the hooks do nothing, so a compiled decode step has logits and no layers.
"""

from __future__ import annotations

import os
import sys

RECORD_ENV = "MIGRATOR_PRECISION_RECORD"
WORKER_MODULE = "executor.core.model_worker.model_worker"
# prefill hidden states of every token are kept up to this many floats over all layers; past it,
# only each request's last token (enough to locate a fault; a long real prompt stays small)
MAX_PREFILL_LAYER_FLOATS = 1 << 24
MAX_CALLS = 4096

_state = {"dir": None, "models": set(), "calls": 0, "current": None, "worker": False, "dtype": None,
          "unbegun": False}


def install(folder: str) -> None:
    """Hooks on the program's torch and upstream's ModelWorker, each once the program imports it: the probe
    never imports torch itself (the recipe's engine imports it through its torch_npu guard; a plain `import
    torch` here would autoload a torch_npu that blocks or lacks CANN, before that guard runs)."""
    _state["dir"] = os.path.join(folder, f"rank_{_rank()}")
    if "torch" in sys.modules:
        _hook_torch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch", _hook_torch))
    sys.meta_path.insert(0, _AfterImport(WORKER_MODULE, _wrap_worker))


def _hook_torch(torch) -> None:
    torch.nn.modules.module.register_module_forward_pre_hook(_find_model)


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _compiling() -> bool:
    import torch

    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


# ---- upstream's ModelWorker: the one place every step's logits pass, compiled or not ----------
class _AfterImport:
    """Calls `then(module)` once the module `name` has run (a meta-path finder that asks the finders after
    it for the module: another hook on it, the npu stand-in's step marker, keeps working)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        start = sys.meta_path.index(self) if self in sys.meta_path else 0
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path[start:]):     # the finders after it: one before it has declined
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def _wrap_worker(module) -> None:
    worker = getattr(module, "ModelWorker", None)
    if worker is not None and hasattr(worker, "inference"):
        worker.inference = _wrap_inference(worker.inference)
        _state["worker"] = True


def _wrap_inference(inference):
    def wrapped(self, model_inputs, is_prefill, *args, **kwargs):
        metadata = model_inputs.get("forward_metadata") if isinstance(model_inputs, dict) else None
        warm_up = bool(getattr(metadata, "is_warm_up", False) or (isinstance(model_inputs, dict)
                                                                   and model_inputs.get("is_warm_up")))
        is_mtp = bool(kwargs.get("is_mtp") or (args and args[0]))
        if warm_up or is_mtp:
            return inference(self, model_inputs, is_prefill, *args, **kwargs)
        ids = model_inputs.get("input_ids")
        ends = getattr(metadata, "actual_seq_lengths_cu_q", None) if is_prefill else None
        cp = getattr(metadata, "cp_metadata", None) if is_prefill else None
        owned = None
        if cp is not None and getattr(cp, "enabled", False) and ids is not None and ends is not None:
            ids, ends, owned = _context_parallel_owned(ids, ends, cp)
        _begin("prefill" if is_prefill else "decode", ids, ends, None)
        if owned is not None and _state["current"] is not None:
            _state["current"]["owned_rows"] = owned
        try:
            result = inference(self, model_inputs, is_prefill, *args, **kwargs)
        except BaseException:
            _state["current"] = None
            raise
        output = result[0] if isinstance(result, tuple) else result
        _end(output)
        return result
    return wrapped


def _context_parallel_owned(ids, ends, cp):
    """A prefill split over context-parallel ranks (upstream's executor: _apply_prefill_cp): every rank runs the
    whole batch, padded, and samples only the requests it decodes (cp_metadata.output_request_indices). The
    record holds those requests as one rank's own: their prompt ids without the padding, their ends, and which
    rows of the model's per-request logits are theirs."""
    import torch

    real = ids.reshape(-1).index_select(0, cp.global_valid_indices.to(ids.device))
    ends = [int(e) for e in ends.tolist()]
    starts = [0, *ends[:-1]]
    owned = [int(i) for i in cp.output_request_indices.tolist()]
    kept = [real[starts[i]:ends[i]] for i in owned]
    lengths = [int(t.numel()) for t in kept]
    own_ends = [sum(lengths[:k + 1]) for k in range(len(lengths))]
    return (torch.cat(kept) if kept else real[:0]), own_ends, owned


# ---- the model and its layers ---------------------------------------------------------------
# what a causal LM's class is named, old and new (GPT2LMHeadModel, CTRLLMHeadModel, XLMWithLMHeadModel)
LM_CLASS_ENDINGS = ("ForCausalLM", "LMHeadModel", "WithLMHead")
_lm_classes: dict[type, bool] = {}


def is_language_model(cls: type) -> bool:
    """A class whose call is the model's step: named as a causal LM is, or one transformers can generate with
    (GenerationMixin among its bases: GPT2LMHeadModel, an image-text model's ForConditionalGeneration)."""
    known = _lm_classes.get(cls)
    if known is None:
        known = _lm_classes[cls] = cls.__name__.endswith(LM_CLASS_ENDINGS) or \
            any(base.__name__ == "GenerationMixin" for base in cls.__mro__[1:])
    return known


def _find_model(module, args):
    if _compiling() or id(module) in _state["models"] or not is_language_model(type(module)):
        return None
    _state["models"].add(id(module))
    if len(_state["models"]) > 1:      # a draft / MTP model: the main model is the first one called
        return None
    import torch

    config = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    try:
        _state["dtype"] = str(next(module.parameters()).dtype).removeprefix("torch.")
    except StopIteration:
        pass
    for _, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and count and len(child) == count:
            for index, layer in enumerate(child):
                layer.register_forward_hook(_layer_hook(index))
            break
    module.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)
    module.register_forward_hook(_model_hook, with_kwargs=True)
    # torch took this call's pre-hooks before this one registered; its forward hooks it takes after the
    # forward, so the call is begun there (its logits recorded, its layers not)
    _state["unbegun"] = True
    return None


def _model_pre_hook(module, args, kwargs):
    # _compiling() before the state is touched: a compiled step that calls the model as a module (an adapter
    # recipe's main_decode) traces this hook, and a write to _state there makes dynamo guard on the whole
    # dict (its call count too): a recompile at every step, until the recompile limit fails the capture
    if _compiling():
        return None
    _state["unbegun"] = False
    if _state["worker"] or kwargs.get("use_cache") is False:
        return None
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    if ids is None or not hasattr(ids, "numel"):
        return None
    metadata = kwargs.get("forward_metadata")
    prefill = bool(metadata.is_prefill) if metadata is not None and hasattr(metadata, "is_prefill") else (
        ids.dim() >= 2 and ids.shape[-1] > 1)
    if metadata is not None and getattr(metadata, "is_warm_up", False):
        return None
    ends = getattr(metadata, "actual_seq_lengths_cu_q", None) if prefill and metadata is not None else None
    mask = kwargs.get("attention_mask")
    mask = mask if prefill and hasattr(mask, "shape") and mask.shape == ids.shape and ids.dim() == 2 else None
    _begin("prefill" if prefill else "decode", ids, ends, mask)
    return None


def _model_hook(module, args, kwargs, output):
    if _compiling():                # first, as in _layer_hook: a traced hook reads no state (no guard on it)
        return None
    if _state["unbegun"]:
        _model_pre_hook(module, args, kwargs)
    if _state["worker"] or _state["current"] is None:
        return None
    _end(output)
    return None


def _layer_hook(index):
    def hook(module, args, output):
        # _compiling() first: a traced hook that read the state would guard on it (None in the warm-up
        # that compiles, a dict in the steps after it) and recompile the decode graph
        if _compiling():
            return None
        current = _state["current"]
        if current is None:
            return None
        hidden = _hidden(output)
        if hidden is not None:
            current["layers"][index] = hidden.detach().float().reshape(-1, hidden.shape[-1]).cpu().clone()
        return None
    return hook


def _hidden(output):
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
        if len(tensors) == 2 and tensors[0].shape == tensors[1].shape:
            return tensors[0].float() + tensors[1].float()
        if tensors:
            return tensors[0]
    return None


# ---- one call: begin, its layers, end ---------------------------------------------------------
def _as_list(value):
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        return None


def _begin(phase, ids, ends, mask) -> None:
    if ids is None or not hasattr(ids, "numel") or _state["calls"] >= MAX_CALLS:
        _state["current"] = None
        return
    _state["current"] = {"phase": phase, "input_ids": ids.detach().reshape(-1).long().cpu().clone(),
                         "shape": list(ids.shape), "seq_ends": _as_list(ends),
                         "attention_mask": None if mask is None else mask.detach().long().cpu().clone(),
                         "layers": {}}


def _end(output) -> None:
    import torch

    current, _state["current"] = _state["current"], None
    if current is None:
        return
    logits = _hidden(output)
    if logits is None:
        return
    logits = logits.detach().float()
    shape = current["shape"]
    window = 1
    if current["phase"] == "decode" and _state["worker"] and logits.dim() == 3 and logits.shape[1] > 1 \
            and len(shape) == 1 and shape[0] == logits.shape[0] * logits.shape[1]:
        # an MTP step of upstream's executor: each request's window (its token and next_n drafts), every
        # position's logits; the check takes the positions the executor accepted
        window = int(logits.shape[1])
        current["rows"] = int(logits.shape[0])
        logits = logits.reshape(-1, logits.shape[-1])
    elif logits.dim() == 3 and logits.shape[1] > 1:          # [B, T, V]: each row's last position
        logits = logits[:, -1, :]
    elif logits.dim() == 2 and current["phase"] == "prefill" and current["seq_ends"] and \
            logits.shape[0] == current["input_ids"].numel() and len(current["seq_ends"]) > 0:
        logits = logits[torch.tensor(current["seq_ends"]) - 1]   # packed [T, V]: each request's last token
    logits = logits.reshape(-1, logits.shape[-1])
    layers = [current["layers"][i] for i in sorted(current["layers"])] or None
    if current.get("owned_rows") is not None:
        # a context-parallel prefill: the rows of this rank's requests; its layers held only its segments
        logits, layers = logits[torch.tensor(current["owned_rows"], dtype=torch.long)], None
        current["rows"] = int(logits.shape[0])
    if layers and current["phase"] == "prefill" and sum(t.numel() for t in layers) > MAX_PREFILL_LAYER_FLOATS:
        layers = None
    record = {"phase": current["phase"], "input_ids": current["input_ids"], "shape": shape,
              "rows": current.get("rows", int(logits.shape[0])), "window": window, "seq_ends": current["seq_ends"],
              "attention_mask": current["attention_mask"], "logits": logits.cpu().clone(),
              "layers": layers, "dtype": _state["dtype"]}
    path = os.path.join(_state["dir"], f"call_{_state['calls']:05d}.pt")

    _state["calls"] += 1
    # the folder the migrator named for this run (it made and checked it), written in the tree of the recipe
    # it names (engine.safe_write.WRITE_ROOT_ENV): nothing through a link out of it
    _safe_write().run_folder_tree(os.path.dirname(_state["dir"]), "the run's precision folder",
                                  create=True).write_with(

        path, lambda tmp: torch.save(record, tmp))



def _safe_write():
    """engine/safe_write.py of infer-migrator, loaded by its path: the recipe's process may carry an
    `engine` package of its own (a standalone recipe's copy), which must not be the one imported here."""
    module = sys.modules.get("_migrator_safe_write")
    if module is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "engine", "safe_write.py")
        spec = importlib.util.spec_from_file_location("_migrator_safe_write", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module
