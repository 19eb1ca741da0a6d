"""Where the model's forward steps begin and end, for the record's per-step counts (record.step_*).

Upstream's executor runs every prefill and decode call of a framework model through
`executor.core.model_worker.model_worker.ModelWorker.inference(model_inputs, is_prefill, is_mtp)`;
when that module is imported, `inference` is wrapped to mark each call as a step. Warm-up calls
(`forward_metadata.is_warm_up`, the test upstream's own `inference` makes) and MTP calls are left out
and counted as such. The decoder layers (the ModuleList of `hf_config.num_hidden_layers` modules in
the worker's model) get hooks that say which layer the calls are in; they are registered on the first
call, the warm-up's, so a graph compiled after it sees them from its first trace; inside a captured
graph they do nothing (no layer attribution for a compiled step). Nothing else changes: the wrapper
returns what `inference` returns. Elsewhere (no upstream executor) the record has no steps.
"""

from __future__ import annotations

import sys

from npu_standin.meta_path import spec_after
from npu_standin import record

WORKER_MODULE = "executor.core.model_worker.model_worker"
GRAPH_MODES = ("ge_graph", "npugraph_ex")
_hooked: set[int] = set()


class WorkerFinder:
    """Wraps ModelWorker.inference once its module has run. It asks the finders after it for the
    module (another hook on the same module, the precision probe's, keeps working) and wraps the
    loader's exec_module."""

    def find_spec(self, name, path=None, target=None):
        if name != WORKER_MODULE:
            return None
        spec = spec_after(self, name, path, target, once=True)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            worker = getattr(module, "ModelWorker", None)
            if worker is not None and callable(getattr(worker, "inference", None)):
                worker.inference = wrap_inference(worker.inference)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if WORKER_MODULE in sys.modules:
        worker = getattr(sys.modules[WORKER_MODULE], "ModelWorker", None)
        if worker is not None and not getattr(worker.inference, "__npu_standin_steps__", False):
            worker.inference = wrap_inference(worker.inference)
        return
    if not any(isinstance(f, WorkerFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, WorkerFinder())


def wrap_inference(inference):
    def inference_marked(self, model_inputs, is_prefill, *args, **kwargs):
        hook_layers(self)
        metadata = model_inputs.get("forward_metadata") if isinstance(model_inputs, dict) else None
        warm_up = bool(getattr(metadata, "is_warm_up", False) or (isinstance(model_inputs, dict)
                                                                   and model_inputs.get("is_warm_up")))
        is_mtp = bool(kwargs.get("is_mtp") or (args and args[0]))
        if warm_up or is_mtp:
            record.step_excluded("warm-up" if warm_up else "mtp")
            return inference(self, model_inputs, is_prefill, *args, **kwargs)
        exe_mode = getattr(self, "exe_mode", None)
        record.step_begin("prefill" if is_prefill else "decode", exe_mode=exe_mode,
                          compiled=exe_mode in GRAPH_MODES and not is_prefill,
                          layers=getattr(self, "_npu_standin_layers", None))
        try:
            return inference(self, model_inputs, is_prefill, *args, **kwargs)
        finally:
            record.step_end()

    inference_marked.__npu_standin_steps__ = True
    inference_marked.__wrapped__ = inference
    return inference_marked


def hook_layers(worker) -> None:
    """Layer hooks on the worker's model (once per model): its ModuleList of num_hidden_layers modules."""
    import torch

    model = getattr(worker, "model", None)
    if not isinstance(model, torch.nn.Module) or id(model) in _hooked:
        return
    _hooked.add(id(model))
    config = getattr(worker, "hf_config", None) or getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    for _, child in model.named_modules():
        if isinstance(child, torch.nn.ModuleList) and count and len(child) == count:
            for index, layer in enumerate(child):
                layer.register_forward_pre_hook(_enter(index))
                layer.register_forward_hook(_leave)
            worker._npu_standin_layers = count
            return


def _enter(index: int):
    def hook(module, args):
        if not record.compiling():
            record.step_layer(index)
    return hook


def _leave(module, args, output):
    if not record.compiling():
        record.step_layer(None)
