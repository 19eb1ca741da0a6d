"""exe_mode "graph": the decode step compiled, on a StaticCache so every step has the same shapes.

The prefill stays eager. The backend is torch.compile/inductor on CPU and CUDA (with CUDA graphs),
torchair's on NPU; the first decode step of the warm-up generation compiles, the formal one reuses
the graph. A runner with the base step hooks gets its whole decode step compiled, gpt-fast style
(ModelRunner.decode_step on static buffers: forward, argmax, pad for finished rows, EOS flags,
position and mask updates); one that overrides a hook gets the compiled forward with its hooks
around it. A model whose step carries another state than a Cache, or builds its own inputs on a
growing cache, runs eager, and the log says why.
"""

from __future__ import annotations

from engine import environment
from engine.traits import StepTraits

torch = environment.import_torch()  # through the guard: see engine.environment.import_torch

CACHE_ROUNDING = 64   # the static cache's length is a multiple of this: nearby lengths share one graph


def compile_options(device, logger, name: str) -> dict | None:
    """torch.compile options for the decode step; None when graph mode can't run here (logged)."""
    if device.type == "npu":
        try:
            import torchair
            from torchair.configs.compiler_config import CompilerConfig
        except ImportError as exc:
            logger.warning(f"{name} exe_mode graph needs torchair on NPU and it cannot be imported ({exc}); "
                           "running eager instead")
            return None
        return {"dynamic": False, "backend": torchair.get_npu_backend(compiler_config=CompilerConfig())}
    if device.type == "cuda":
        return {"dynamic": False, "mode": "reduce-overhead"}  # inductor + CUDA graphs: one launch per step
    return {"dynamic": False}  # inductor


def refusal(traits: StepTraits) -> str | None:
    """Why this model's decode step cannot run on a StaticCache with fixed shapes, or None."""
    if not traits.carries_a_cache:
        return (f"it carries its own state from step to step (`{traits.cache_kwarg}`, returned by each "
                f"forward), not a transformers Cache a StaticCache could stand in for")
    if traits.builds_own_step:
        return ("its own generation step (prepare_inputs_for_generation) feeds it other tokens than the "
                "sequence's, on a cache that grows each step")
    return None


class StaticDecode:
    """One StaticCache and the decode state's static buffers, kept between generations of the same
    shape and marked static, so the compiled step sees the same tensors: no recompilation in the
    formal run and, with CUDA graphs, no copies."""

    def __init__(self, model, device, options: dict, whole_step=None):
        self.model, self.device = model, device
        self.backend = "torchair" if "backend" in options else "inductor" + (", CUDA graphs" if "mode" in options else "")
        self.forward = torch.compile(model, **options)
        self.step = torch.compile(whole_step, **options) if whole_step is not None else None
        self.cache: object | None = None
        self.shape: tuple[int, int] | None = None     # (rows, cache length)
        self.buffers: dict | None = None

    def new_cache(self, batch_size: int, max_cache_len: int):
        from transformers.cache_utils import StaticCache

        max_cache_len = -(-max_cache_len // CACHE_ROUNDING) * CACHE_ROUNDING
        if self.cache is not None and self.shape == (batch_size, max_cache_len):
            with torch.inference_mode():  # its tensors were made in the last generation's forwards
                self.cache.reset()
            return self.cache
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len)
        self.shape = (batch_size, max_cache_len)
        return self.cache

    def padded_forward(self, **model_inputs):
        """The compiled forward for a runner's own hooks: the 2D mask grows a column a step, so it is
        padded to the cache length (as the model would pad it) and the graph sees one shape."""
        mask = model_inputs.get("attention_mask")
        if mask is None:  # a model whose step takes none (mamba)
            return self.forward(**model_inputs)
        pad = self.shape[1] - mask.shape[-1]
        return self.forward(**{**model_inputs, "attention_mask": torch.nn.functional.pad(mask, (0, pad))})

    @torch.inference_mode()
    def static_batch(self, batch: dict) -> dict:
        """After prefill: the batch as static buffers the compiled step updates in place (a
        `step` and a `next_column` cursor say where the next token's id and mask column go). Keyed
        on the cache's shape only: another max_new_tokens in the same cache reuses buffers and graph."""
        rows, cache_len = self.shape
        if self.buffers is None or self.buffers["shape"] != (rows, cache_len):
            long = dict(dtype=torch.long, device=self.device)
            buffers = {
                "next_tokens": torch.zeros(rows, **long),
                "position_ids": torch.zeros(rows, 1, **long),
                "attention_mask": torch.zeros(rows, cache_len, dtype=batch["attention_mask"].dtype, device=self.device),
                "next_column": torch.zeros(1, **long),
                "generate_ids": torch.zeros(rows, cache_len, **long),
                "step": torch.zeros(1, **long),
                "finished": torch.zeros(rows, dtype=torch.bool, device=self.device),
            }
            for tensor in buffers.values():
                torch._dynamo.mark_static_address(tensor)
            self.buffers = dict(buffers, shape=(rows, cache_len))
        static = self.buffers
        mask = batch["attention_mask"]  # prompt + the prefill's token
        static["attention_mask"].zero_()[:, :mask.shape[1]] = mask
        static["next_column"].fill_(mask.shape[1])
        static["next_tokens"].copy_(batch["next_tokens"])
        static["position_ids"].copy_(batch["position_ids"][:, -1:])
        static["generate_ids"].fill_(0)[:, :batch["generate_ids"].shape[1]] = batch["generate_ids"]
        static["step"].fill_(batch["generate_ids"].shape[1])
        static["finished"].copy_(batch["finished"])
        return {**{k: v for k, v in static.items() if k != "shape"}, "input_ids": batch["input_ids"],
                "cache": batch["cache"], "is_prefill": False}
