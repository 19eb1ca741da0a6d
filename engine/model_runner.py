"""The shared runtime every recipe's Runner subclasses.

A recipe's Runner names its model and configuration classes (`model_class`, `config_class`) and
overrides only what its model does differently. The Runner contract: `init_model()`,
`model_input_prepare(batch)`, `model_output_process(model_inputs, outputs, batch)` (one causal-LM
step: the defaults below) and `model_generate(prompts, warm_up=False)`, which tokenizes and runs
the loop in engine/generate.py:

    prefill (first forward) -> decode_one_token ... -> EOS or max_new_tokens

exe_mode "graph": the prefill stays eager; the decode step is compiled (chosen in `init_model`:
torch.compile/inductor on CPU and CUDA, torchair's backend on NPU) and runs on a StaticCache
(`new_cache`), so every step has the same shapes and one graph serves them all. With the base hooks
the whole step is compiled, gpt-fast style (`decode_step` on static buffers: forward, argmax, pad
for finished rows, EOS flags, position and mask updates); a runner that overrides a hook gets the
compiled forward (`decode_forward`) with its hooks around it. The first decode step of the warm-up
generation compiles it; the formal generation reuses the graph.

Runners rendered before the engine owned the loop (release pre-redesign) still run: they pass the
classes to `init_model`, build the batch themselves and call
`model_generate(input_dict, input_lens, warm_up)`; see `model_generate`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random

from engine import defaults, environment

# Before any other torch import: with torch_npu installed but no CANN, a plain `import torch`
# fails in torch's backend auto-load (see engine.environment.import_torch).
torch = environment.import_torch()

from engine.generate import (CACHE_CLASS_NAMES, PARITY_DUMP_ENV, builds_own_step, cache_argument,  # noqa: E402
                             decodes_without_mask, generate, generation_cache, wants_full_sequence)
from engine.logging_utils import get_logger  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


class ModelRunner:
    model_class = None   # the recipe's Runner names its vendored classes here
    config_class = None

    def __init__(self, runner_settings: dict):
        self.runner_settings = runner_settings
        self.model_name = runner_settings["model_name"]
        self.model_path = runner_settings["model_path"]
        self.exe_mode = runner_settings.get("exe_mode", "eager")
        model_config = runner_settings.get("model_config", {})
        data_config = runner_settings.get("data_config", {})
        self.dtype = DTYPES[model_config.get("dtype", "float32")]
        self.attn_implementation = model_config.get("attn_implementation", "sdpa")
        self.input_max_len = data_config.get("input_max_len", defaults.INPUT_MAX_LEN)
        self.max_new_tokens = data_config.get("max_new_tokens", defaults.MAX_NEW_TOKENS)
        self.batch_size = data_config.get("batch_size", 1)
        self.rank = int(os.environ.get("RANK", runner_settings.get("rank", 0)))
        self.world_size = int(os.environ.get("WORLD_SIZE", runner_settings.get("world_size", 1)))
        seed_everything(runner_settings.get("seed", 42))
        self.device = environment.select_device(runner_settings.get("device", "auto"))
        # Tensor parallel over groups of attn_tp_size consecutive ranks; data parallel over the groups.
        parallel = runner_settings.get("parallel_config") or {}
        self.tp_size = int(parallel.get("attn_tp_size", 1))
        self.moe_tp_size = int(parallel.get("moe_tp_size", 1))
        self.lmhead_tp_size = int(parallel.get("lmhead_tp_size", 1))
        check_parallel_sizes(self.world_size, self.tp_size, self.moe_tp_size, self.lmhead_tp_size)
        self.dp_size = self.world_size // self.tp_size
        self.dp_rank, self.tp_rank = divmod(self.rank, self.tp_size)
        if self.world_size > 1:
            self.device = init_distributed(self.device, int(os.environ.get("LOCAL_RANK", 0)))
        # Vendored code patched away from hard-coded "cuda" asks for the device here.
        os.environ["RECIPE_DEVICE"] = str(self.device)
        self.logger = get_logger(self.model_name, self.rank)
        self.model = None
        self.tokenizer = None
        self.decode_forward = None  # set by init_model: the model itself, or its compiled decode step
        self.static_cache = None  # graph mode: one StaticCache, reset between generations
        self.compiled_decode_step = None  # graph mode, base hooks: decode_step compiled (the whole step)
        self.decode_state = None  # the static buffers decode_step reads and updates in place
        self.parity_dump = None   # formal run, MIGRATOR_PARITY_DUMP set: the prompt, saved when generation ends

    # ---- model and tokenizer -------------------------------------------------------------
    def init_model(self, model_cls=None, config_cls=None):
        """Load config, weights (safetensors, configured dtype) and tokenizer from model_path.

        The classes default to the Runner's `model_class` / `config_class`; runners rendered
        before those existed pass them."""
        model_cls = model_cls or self.model_class
        config_cls = config_cls or self.config_class
        # Graph mode settles its backend first: a fall-back to eager shows in the environment line.
        graph_options = self.graph_compile_options() if self.exe_mode == "graph" else None
        env = environment.detect_environment(self.device.type)
        env.update(device=self.device.type, exe_mode=self.exe_mode, world_size=self.world_size)
        self.logger.info(f"{self.model_name} environment: {json.dumps(env, sort_keys=True)}")
        model_config = self.runner_settings.get("model_config", {})
        # config_overrides: recipe-level corrections (e.g. tie_word_embeddings) without
        # touching the user's checkpoint.
        config = config_cls.from_pretrained(self.model_path, local_files_only=True,
                                            **model_config.get("config_overrides", {}))
        check_lengths(config, self.input_max_len, self.max_new_tokens)
        reuse_checkpoint_conversions(model_cls, config)
        parallel_kwargs = {}
        if self.tp_size > 1:
            # transformers shards the weights while loading, by the plan its configuration class
            # (vendored with the model) carries: each rank reads only its slices from the checkpoint.
            parallel_kwargs["distributed_config"] = tensor_parallel_config(
                model_cls, config, self.tp_size, self.dp_size, self.moe_tp_size, self.lmhead_tp_size)
        # Recipes never fetch at run time: everything comes from model_path.
        self.model, info = model_cls.from_pretrained(
            self.model_path,
            config=config,
            runner_settings=self.runner_settings,
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
            local_files_only=True,
            output_loading_info=True,
            # key_mapping: regex -> replacement for checkpoint keys named differently from the code.
            key_mapping=model_config.get("key_mapping") or None,
            **parallel_kwargs,
        )
        check_loading_info(info, self.model_path)
        if parallel_kwargs:
            check_tied_lm_head(self.model)
        if not parallel_kwargs:  # tensor-parallel loading already placed each shard on this rank's device
            self.model.to(self.device)
        self.model.eval()
        self.tokenizer = load_tokenizer(self.model_path)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.eos_ids = torch.tensor(self.eos_token_ids(), dtype=torch.long, device=self.device)
        self.forward_params = set(inspect.signature(self.model.forward).parameters)
        self.cache_kwarg = cache_argument(self.forward_params)
        # The bytes this rank holds: a tensor-parallel weight counts with its local shard only.
        self.model_bytes = rank_weight_bytes(self.model)
        shard = f", tensor parallel rank {self.tp_rank} of {self.tp_size}" if self.tp_size > 1 else ""
        self.decode_full_sequence = wants_full_sequence(self.model)
        self.model_builds_step = builds_own_step(self.model)
        self.decode_without_mask = decodes_without_mask(self.model)
        self.logger.info(
            f"{self.model_name} loaded {model_cls.__name__} ({self.model_bytes / 1e6:.1f} MB, "
            f"{str(self.dtype).removeprefix('torch.')}{shard}) on {self.device}")
        check_device_memory(self.device, self.model_bytes)
        self.decode_forward = self.build_decode_forward(graph_options)

    def graph_compile_options(self) -> dict | None:
        """torch.compile options for the decode step; None (and exe_mode eager) when graph mode can't run."""
        if self.device.type == "npu":
            try:
                import torchair
                from torchair.configs.compiler_config import CompilerConfig
            except ImportError as exc:
                self.logger.warning(f"{self.model_name} exe_mode graph needs torchair on NPU and it cannot be "
                                    f"imported ({exc}); running eager instead")
                self.exe_mode = "eager"
                return None
            return {"dynamic": False, "backend": torchair.get_npu_backend(compiler_config=CompilerConfig())}
        if self.device.type == "cuda":
            return {"dynamic": False, "mode": "reduce-overhead"}  # inductor + CUDA graphs: one launch per step
        return {"dynamic": False}  # inductor

    def build_decode_forward(self, options: dict | None):
        """Eager: the model. Graph: the model compiled with fixed shapes for one-token steps (it
        compiles on its first call, the warm-up run's first decode step).

        A runner that keeps the base step hooks gets the whole step compiled instead
        (`compiled_decode_step`: forward, greedy token, EOS flags, position and mask updates); one
        that overrides them keeps the compiled forward and runs its hooks around it."""
        if options is None:
            return self.model
        reason = self.static_decode_refusal()
        if reason:
            self.logger.warning(f"{self.model_name} exe_mode graph does not apply to {type(self.model).__name__}: "
                                f"{reason}; running eager instead")
            self.exe_mode = "eager"
            return self.model
        backend = "torchair" if "backend" in options else "inductor" + (", CUDA graphs" if "mode" in options else "")
        if self.uses_base_step_hooks() and not self.decode_full_sequence:
            self.compiled_decode_step = torch.compile(self.decode_step, **options)
            what = "whole decode step (forward, argmax, EOS flags, position and mask updates)"
        else:
            what = "forward; the runner's own step hooks run around it"
        self.logger.info(f"{self.model_name} exe_mode graph: decode step compiled with torch.compile "
                         f"({backend}) in the warm-up run, static KV cache; prefill eager; compiled: {what}")
        return torch.compile(self.model, **options)

    def static_decode_refusal(self) -> str | None:
        """Why this model's decode step cannot run on a StaticCache with fixed shapes, or None."""
        if self.cache_kwarg not in CACHE_CLASS_NAMES:
            return (f"it carries its own state from step to step (`{self.cache_kwarg}`, returned by each "
                    f"forward), not a transformers Cache a StaticCache could stand in for")
        if self.model_builds_step:
            return ("its own generation step (prepare_inputs_for_generation) feeds it other tokens than the "
                    "sequence's, on a cache that grows each step")
        return None

    def uses_base_step_hooks(self) -> bool:
        return (type(self).model_input_prepare is ModelRunner.model_input_prepare
                and type(self).model_output_process is ModelRunner.model_output_process)

    def new_cache(self, batch_size: int, max_cache_len: int):
        """The KV cache for one generation of `batch_size` prompts up to `max_cache_len` tokens.

        Eager: the cache transformers' generate() starts with (`generation_cache`): a DynamicCache
        the forward fills in place, returned or not (recurrent_gemma's forward does not return it),
        or None for a model that makes its own or carries its own state (rwkv, xlnet); the runner
        keeps what the forward returns. Graph: a StaticCache of
        [batch, kv_heads, max_cache_len, head_dim] per layer; the length is rounded up to a multiple
        of 64 and the cache is kept and reset between generations, so the compiled step sees the
        same shapes and the same tensors (no recompilation in the formal run).
        """
        from transformers.cache_utils import StaticCache

        if self.exe_mode != "graph":
            return generation_cache(self.model, self.cache_kwarg)
        max_cache_len = -(-max_cache_len // 64) * 64
        if self.static_cache is not None and self.static_cache_shape == (batch_size, max_cache_len):
            with torch.inference_mode():  # its tensors were made in the last generation's forwards
                self.static_cache.reset()
            return self.static_cache
        self.static_cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len)
        self.static_cache_shape = (batch_size, max_cache_len)
        return self.static_cache

    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return []
        return list(ids) if isinstance(ids, (list, tuple)) else [ids]

    def close(self):
        """End of a (multi-rank) run: wait for every rank, then leave the process group."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- one causal-LM step (engine/generate.py runs the loop): override what differs ------
    def synchronize(self):
        environment.synchronize(self.device)

    def start_batch(self, prompts: list[str]) -> dict:
        """The generation's state: the prompts tokenized (left padding, cut at input_max_len)."""
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True, truncation=True,
                                max_length=self.input_max_len).to(self.device)
        input_ids = inputs["input_ids"]
        batch = input_ids.shape[0]
        return {
            "input_ids": input_ids,
            "attention_mask": inputs["attention_mask"],
            "generate_ids": input_ids.new_zeros((batch, 0)),
            "finished": torch.zeros(batch, dtype=torch.bool, device=self.device),
            # generate()'s cache in eager mode (None for a model that makes its own), a reused
            # StaticCache in graph mode.
            "cache": self.new_cache(batch, input_ids.shape[1] + self.max_new_tokens),
            "is_prefill": True,
        }

    def model_input_prepare(self, batch: dict) -> dict:
        """The forward's kwargs: the prompt at prefill, then the last token."""
        attention_mask = batch["attention_mask"]
        if batch["is_prefill"]:
            input_ids = batch["input_ids"]
            # Left padding: positions count real tokens only (as transformers' generate does).
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
        else:
            input_ids = batch["next_tokens"][:, None]
            position_ids = batch["position_ids"][:, -1:] + 1
            if getattr(self, "decode_without_mask", False):
                attention_mask = None  # as the model's own step (mamba); the batch keeps the mask
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                        self.cache_kwarg: batch["cache"], "use_cache": True}
        if "logits_to_keep" in self.forward_params:
            model_inputs["logits_to_keep"] = 1  # only the last position's logits are needed
        return model_inputs

    def model_output_process(self, model_inputs: dict, outputs, batch: dict) -> None:
        """Greedy next tokens into `batch`; the mask, positions and cache move one step on."""
        next_tokens = outputs.logits[:, -1, :].argmax(dim=-1)
        finished = batch["finished"]
        # Finished requests keep receiving the pad token so the batch stays rectangular.
        next_tokens = torch.where(finished, torch.full_like(next_tokens, self.pad_token_id), next_tokens)
        batch["generate_ids"] = torch.cat([batch["generate_ids"], next_tokens[:, None]], dim=-1)
        batch["finished"] = finished | torch.isin(next_tokens, self.eos_ids)
        batch["next_tokens"] = next_tokens
        batch["position_ids"] = model_inputs["position_ids"]
        mask = batch["attention_mask"]
        batch["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        batch["is_prefill"] = False
        # Eager: the model built its cache at prefill (its own class for hybrid models), or returned
        # its recurrent state under its own name (rwkv `state`, xlnet `mems`): keep it for the next step.
        returned = outputs.get(self.cache_kwarg, outputs.get("cache", outputs.get("past_key_values")))
        if returned is not None:
            batch["cache"] = returned

    # ---- graph mode with the base hooks: the whole decode step compiled (gpt-fast style) -------
    @torch.inference_mode()
    def start_static_decode(self, batch: dict) -> dict | None:
        """After prefill: the decode state in static buffers for `compiled_decode_step`, or None
        when the step runs through the hooks (eager, a runner with its own hooks, a dynamic cache).

        The buffers are kept between generations of the same shape (like the StaticCache) and
        marked static so the compiled step sees the same tensors: no recompilation in the formal
        run and, with CUDA graphs, no copies. `batch` then holds the state's `generate_ids`
        (generate keeps the columns it produced) and `finished`."""
        if self.compiled_decode_step is None or batch.get("cache") is not self.static_cache:
            return None
        rows, cache_len = self.static_cache_shape
        # Keyed on the cache's shape only (generate_ids is cache_len wide, more than max_new_tokens):
        # a generation with another max_new_tokens in the same cache reuses the buffers and the graph.
        if self.decode_state is None or self.decode_state["shape"] != (rows, cache_len):
            long = dict(dtype=torch.long, device=self.device)
            buffers = {
                "next_tokens": torch.zeros(rows, **long),
                "position_ids": torch.zeros(rows, 1, **long),
                # Preallocated at the cache length: each step sets the next token's column in place.
                "attention_mask": torch.zeros(rows, cache_len, dtype=batch["attention_mask"].dtype, device=self.device),
                "next_column": torch.zeros(1, **long),
                "generate_ids": torch.zeros(rows, cache_len, **long),
                "step": torch.zeros(1, **long),
                "finished": torch.zeros(rows, dtype=torch.bool, device=self.device),
            }
            for tensor in buffers.values():
                torch._dynamo.mark_static_address(tensor)
            self.decode_state = dict(buffers, shape=(rows, cache_len))
        state = self.decode_state
        mask = batch["attention_mask"]  # prompt + the prefill's token
        state["attention_mask"].zero_()[:, :mask.shape[1]] = mask
        state["next_column"].fill_(mask.shape[1])
        state["next_tokens"].copy_(batch["next_tokens"])
        state["position_ids"].copy_(batch["position_ids"][:, -1:] + 1)
        state["generate_ids"].fill_(self.pad_token_id)[:, :1] = batch["generate_ids"]
        state["step"].fill_(1)
        state["finished"].copy_(batch["finished"])
        batch.update(generate_ids=state["generate_ids"], finished=state["finished"])
        return state

    def decode_step(self, state: dict) -> None:
        """One greedy decode step on `state`'s buffers, all in place (compiled in graph mode):
        the same computation as model_input_prepare + forward + model_output_process."""
        mask = None if getattr(self, "decode_without_mask", False) else state["attention_mask"]
        model_inputs = {"input_ids": state["next_tokens"][:, None], "attention_mask": mask,
                        "position_ids": state["position_ids"], self.cache_kwarg: self.static_cache, "use_cache": True}
        if "logits_to_keep" in self.forward_params:
            model_inputs["logits_to_keep"] = 1
        next_tokens = self.model(**model_inputs).logits[:, -1, :].argmax(dim=-1)
        finished = state["finished"]
        next_tokens = torch.where(finished, torch.full_like(next_tokens, self.pad_token_id), next_tokens)
        state["generate_ids"].index_copy_(1, state["step"], next_tokens[:, None])
        finished.logical_or_(torch.isin(next_tokens, self.eos_ids))
        state["next_tokens"].copy_(next_tokens)
        state["position_ids"].add_(1)
        state["attention_mask"].index_fill_(1, state["next_column"], 1)
        state["next_column"].add_(1)
        state["step"].add_(1)

    def model_generate(self, prompts, warm_up=False, *legacy) -> list[str]:
        """Greedy generation for `prompts`; the texts.

        A runner rendered before the engine owned the loop calls
        `model_generate(input_dict, input_lens, warm_up)` with the batch it built itself."""
        if isinstance(prompts, dict):  # legacy: warm_up is the third argument, after input_lens
            return generate(self, prompts, warm_up=bool(legacy and legacy[0]))
        return generate(self, self.start_batch(prompts), warm_up)

    def dump_prefill(self, model_inputs: dict, outputs) -> None:
        """The formal run's prompt and last-position logits, for the migrator's parity check: the
        reference model is compared against them afterwards, so no process holds two models.

        `outputs` is None when the step's forward was not the prompt's (a model that builds its own
        step: xlm predicts at an appended mask token). Kept until the generation has ended
        (`save_parity_dump`): the forwards the dump still needs must not run between two steps, where
        they would disturb a model that keeps its state in its modules (recurrent_gemma's forward
        without the cache clears its recurrent state)."""
        self.parity_dump = {"model_inputs": model_inputs,
                            "logits": None if outputs is None else outputs.logits[:, -1, :].float().cpu()}

    def save_parity_dump(self, generate_ids) -> None:
        """After the formal run: the prompt's logits where the prefill did not give them, and how well
        the weights predict the prompt (untrained weights write noise by design), from forwards over
        the prompt without the cache, after the timed loop, so no timing changes. Every rank runs them
        (with tensor parallel a forward is a collective); rank 0 writes the dump."""
        model_inputs, logits = self.parity_dump["model_inputs"], self.parity_dump["logits"]
        self.parity_dump = None
        kwargs = {k: v for k, v in model_inputs.items() if k not in (self.cache_kwarg, "logits_to_keep", "use_cache")}

        def prompt_logits():
            with torch.inference_mode():
                return self.model(**kwargs, use_cache=False).logits.float()

        full = prompt_logits() if logits is None else None
        dump = {"input_ids": model_inputs["input_ids"].cpu(), "attention_mask": model_inputs["attention_mask"].cpu(),
                "logits": logits if full is None else full[:, -1, :].cpu(),
                "dtype": str(self.dtype).removeprefix("torch."), "device": self.device.type,
                "generate_ids": generate_ids.cpu()}
        try:
            full = (prompt_logits() if full is None else full)[0, :-1]
            ids = model_inputs["input_ids"][0, 1:]
            dump["prompt_nll"] = torch.nn.functional.cross_entropy(full, ids).item()
            dump["uniform_nll"] = math.log(full.shape[-1])
        except Exception:  # noqa: BLE001 - the parity check then computes it itself
            pass
        if self.rank == 0:
            # Written once, when the formal run is complete: a partial dump never exists.
            torch.save(dump, os.environ[PARITY_DUMP_ENV])


def init_distributed(device, local_rank: int):
    """torchrun started this rank: one device per rank, hccl / nccl / gloo by device."""
    import torch.distributed as dist

    if device.type in ("npu", "cuda"):
        device = torch.device(device.type, local_rank)
        getattr(torch, device.type).set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend={"npu": "hccl", "cuda": "nccl"}.get(device.type, "gloo"))
    return device


def check_parallel_sizes(world_size: int, tp: int, moe_tp: int, lmhead_tp: int) -> None:
    """attn_tp_size divides world_size; MoE experts and lm_head are sharded on the same group or not at all."""
    if world_size % tp:
        raise ValueError(f"parallel_config.attn_tp_size={tp} must divide world_size={world_size}")
    for key, size in (("moe_tp_size", moe_tp), ("lmhead_tp_size", lmhead_tp)):
        if size not in (1, tp):
            raise ValueError(f"parallel_config.{key}={size} must be 1 (replicated) or attn_tp_size={tp} "
                             f"(sharded on the attention's tensor-parallel group)")


def families_with_tp_plan() -> list[str]:
    """model_types whose transformers configuration class declares a tensor-parallel plan (read from
    the configuration modules' source: importing all of them takes half a minute)."""
    import re
    from pathlib import Path

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


def tensor_parallel_config(model_cls, config, tp: int, dp: int, moe_tp: int, lmhead_tp: int):
    """transformers' DistributedConfig for attn_tp_size-way tensor parallel within each of `dp` replicas.

    The plan is the model's own (`base_model_tp_plan` of its configuration class, `_tp_plan` of the
    model class, both vendored into the recipe). moe_tp_size 1 keeps the experts whole on every
    rank; lmhead_tp_size 1 keeps lm_head whole. A family without a plan is refused.
    """
    from transformers.distributed import DistributedConfig

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = dict(getattr(text_config, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        import transformers

        families = families_with_tp_plan()
        raise ValueError(
            f"parallel_config.attn_tp_size={tp}: {getattr(config, 'model_type', model_cls.__name__)} has no "
            f"tensor-parallel plan in transformers {transformers.__version__}; set attn_tp_size: 1 (world_size "
            f"then splits the batch only). Families with a plan ({len(families)}): {', '.join(families)}")
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


def rank_weight_bytes(model) -> int:
    """Bytes of the weights this rank holds: a sharded weight (DTensor or local slice) counts its shard."""
    total = 0
    for param in model.parameters():
        data = param.to_local() if hasattr(param, "to_local") else param
        total += data.numel() * data.element_size()
    return total


def check_device_memory(device, held_bytes: int) -> None:
    """MIGRATOR_DEVICE_MEMORY_BYTES (tests and CPU only): a simulated card of that many bytes.

    A CPU has no per-card memory to run out of; with this set, a rank whose weights exceed the
    "card" fails as a full NPU would. Ignored on real devices.
    """
    from engine.environment import simulated_card_bytes

    card = simulated_card_bytes()
    if card and device.type == "cpu" and held_bytes > card:
        raise torch.OutOfMemoryError(
            f"CPU out of memory (simulated card of {card} bytes, MIGRATOR_DEVICE_MEMORY_BYTES): "
            f"this rank holds {held_bytes} bytes of weights")


def check_lengths(config, input_max_len: int, max_new_tokens: int) -> None:
    """Prompt + generated tokens must fit the positions the model was built for."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text_config, "max_position_embeddings", None)
    # A limit of -1 (xlnet) or 0 means none: relative positions.
    if isinstance(limit, int) and limit > 0 and input_max_len + max_new_tokens > limit:
        raise ValueError(
            f"data_config.input_max_len ({input_max_len}) + data_config.max_new_tokens ({max_new_tokens}) "
            f"exceeds max_position_embeddings ({limit}); lower them in the YAML")


def reuse_checkpoint_conversions(model_cls, config) -> None:
    """Apply transformers' checkpoint key conversions (renamed or fused weights) to vendored code.

    transformers applies them only to its own classes; a vendored copy counts as custom code
    and would load with weights silently missing. Registering the same mapping under the
    class name / model_type opts the vendored class in.
    """
    try:
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
    except ImportError:  # older transformers: no conversions to reuse
        return
    for key in (model_cls.__name__, getattr(config, "model_type", None)):
        mapping = get_checkpoint_conversion_mapping(key) if key else None
        if mapping is not None:
            register_checkpoint_conversion_mapping(key, mapping, overwrite=True)


def check_loading_info(info: dict, model_path: str) -> None:
    """Refuse to run with weights that were not in the checkpoint (they would be random)."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        unexpected = sorted(info.get("unexpected_keys") or [])
        raise RuntimeError(
            f"state dict mismatch loading {model_path}: missing keys {missing[:8]}, "
            f"unexpected keys {unexpected[:8]}, mismatched shapes {mismatched[:8]}")


def load_tokenizer(model_path: str, padding_side: str = "left"):
    """AutoTokenizer from the checkpoint, left padding, and a pad token even if none is defined."""
    from transformers import AutoTokenizer

    # trust_remote_code=False: never prompt, never run a repo's tokenizer code at recipe run time.
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True, trust_remote_code=False)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            # Never add a token: its id would fall outside the embedding table. Padded
            # positions are masked out, so any existing id will do.
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    return tokenizer
