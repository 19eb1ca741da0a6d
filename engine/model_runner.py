"""The shared runtime every recipe's Runner subclasses.

A recipe's Runner names its model and configuration classes (`model_class`, `config_class`) and
overrides only what its model does differently. The Runner contract: `init_model()`,
`model_input_prepare(batch)`, `model_output_process(model_inputs, outputs, batch)` (one causal-LM
step: the defaults below) and `model_generate(prompts, warm_up=False)`, which tokenizes and runs
the loop in engine/generate.py. Graph mode is engine/graph_mode.py; loading, engine/loading.py;
tensor parallel, engine/parallel.py; the parity dump, engine/parity_dump.py.

A runner that builds its own batch (the recipes rendered before the engine owned the loop) passes
the classes to `init_model` and calls `model_generate(input_dict, input_lens, warm_up)`.
"""

from __future__ import annotations

import inspect
import json
import os

from engine import environment, graph_mode, loading, parallel
from engine.config import check_parallel, setting

# Before any other torch import: with torch_npu installed but no CANN, a plain `import torch`
# fails in torch's backend auto-load (see engine.environment.import_torch). Runners import it from here.
torch = environment.import_torch()

from engine.generate import full_sequence_inputs, generate, step_inputs  # noqa: E402
from engine.loading import DTYPES, load_tokenizer  # noqa: E402
from engine.logging_utils import get_logger  # noqa: E402
from engine.traits import StepTraits, generation_cache, probe_step  # noqa: E402


class ModelRunner:
    model_class = None   # the recipe's Runner names its vendored classes here
    config_class = None

    def __init__(self, runner_settings: dict):
        self.runner_settings = runner_settings
        self.model_name, self.model_path = runner_settings["model_name"], runner_settings["model_path"]
        self.exe_mode = setting(runner_settings, "exe_mode")
        self.dtype = DTYPES[setting(runner_settings, "model_config.dtype")]
        self.attn_implementation = setting(runner_settings, "model_config.attn_implementation")
        self.input_max_len = setting(runner_settings, "data_config.input_max_len")
        self.max_new_tokens = setting(runner_settings, "data_config.max_new_tokens")
        self.batch_size = setting(runner_settings, "data_config.batch_size")
        self.rank = int(os.environ.get("RANK", runner_settings.get("rank", 0)))
        self.world_size = int(os.environ.get("WORLD_SIZE", setting(runner_settings, "world_size")))
        loading.seed_everything(runner_settings.get("seed", 42))
        self.device = environment.select_device(setting(runner_settings, "device"))
        self.tp_size = setting(runner_settings, "parallel_config.attn_tp_size")
        self.moe_tp_size = setting(runner_settings, "parallel_config.moe_tp_size")
        self.lmhead_tp_size = setting(runner_settings, "parallel_config.lmhead_tp_size")
        check_parallel({"world_size": self.world_size, "parallel_config": {
            "attn_tp_size": self.tp_size, "moe_tp_size": self.moe_tp_size, "lmhead_tp_size": self.lmhead_tp_size}})
        self.dp_size = self.world_size // self.tp_size
        self.dp_rank, self.tp_rank = divmod(self.rank, self.tp_size)
        if self.world_size > 1:
            self.device = parallel.init_distributed(torch, self.device, int(os.environ.get("LOCAL_RANK", 0)))
        # Vendored code patched away from hard-coded "cuda" asks for the device here.
        os.environ["RECIPE_DEVICE"] = str(self.device)
        self.logger = get_logger(self.model_name, self.rank)
        self.model = self.tokenizer = None
        self.traits = StepTraits()          # how the model steps: probed once it is loaded
        self.graph: graph_mode.StaticDecode | None = None   # graph mode: static cache, compiled step
        self.parity_dump = None             # the formal run's prompt, saved when generation ends

    @property
    def cache_kwarg(self) -> str:
        return self.traits.cache_kwarg

    # ---- model and tokenizer -------------------------------------------------------------
    def init_model(self, model_cls=None, config_cls=None):
        """Load config, weights (safetensors, configured dtype) and tokenizer from model_path. The
        classes default to the Runner's `model_class` / `config_class`."""
        model_cls, config_cls = model_cls or self.model_class, config_cls or self.config_class
        # Graph mode settles its backend first: a fall-back to eager shows in the environment line.
        options = graph_mode.compile_options(self.device, self.logger, self.model_name) \
            if self.exe_mode == "graph" else None
        if options is None:
            self.exe_mode = "eager"
        env = environment.detect_environment(self.device.type)
        env.update(exe_mode=self.exe_mode, world_size=self.world_size)
        self.logger.info(f"{self.model_name} environment: {json.dumps(env, sort_keys=True)}")
        model_config = self.runner_settings.get("model_config", {})
        # config_overrides: recipe-level corrections (e.g. tie_word_embeddings) without touching the checkpoint.
        config = config_cls.from_pretrained(self.model_path, local_files_only=True,
                                            **model_config.get("config_overrides", {}))
        loading.check_lengths(config, self.input_max_len, self.max_new_tokens)
        sharded = {"distributed_config": parallel.tensor_parallel_config(
            model_cls, config, self.tp_size, self.dp_size, self.moe_tp_size, self.lmhead_tp_size)} \
            if self.tp_size > 1 else {}
        model = loading.load_model(model_cls, config, self.model_path, self.runner_settings, self.dtype,
                                   self.attn_implementation, model_config.get("key_mapping"), sharded)
        if sharded:
            parallel.check_tied_lm_head(model)
        else:   # tensor-parallel loading already placed each shard on this rank's device
            model.to(self.device)
        self.use_model(model.eval(), load_tokenizer(self.model_path), options)
        shard = f", tensor parallel rank {self.tp_rank} of {self.tp_size}" if self.tp_size > 1 else ""
        self.logger.info(f"{self.model_name} loaded {model_cls.__name__} ({self.model_bytes / 1e6:.1f} MB, "
                         f"{str(self.dtype).removeprefix('torch.')}{shard}) on {self.device}")
        loading.check_device_memory(self.device, self.model_bytes)

    def use_model(self, model, tokenizer, graph_options: dict | None = None) -> None:
        """Run `model`: how it steps is asked of it once, and graph mode is set up for it."""
        self.model, self.tokenizer = model, tokenizer
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_ids = torch.tensor(self.eos_token_ids(), dtype=torch.long, device=self.device)
        self.traits = probe_step(model)
        self.forward_params = set(inspect.signature(model.forward).parameters)
        self.model_bytes = loading.rank_weight_bytes(model)   # a tensor-parallel weight: its local shard
        self.graph = self.graph_decode(graph_options) if graph_options is not None else None

    def graph_decode(self, options: dict) -> graph_mode.StaticDecode | None:
        reason = graph_mode.refusal(self.traits)
        if reason:
            self.logger.warning(f"{self.model_name} exe_mode graph does not apply to {type(self.model).__name__}: "
                                f"{reason}; running eager instead")
            self.exe_mode = "eager"
            return None
        whole = self.uses_base_step_hooks() and not self.traits.full_sequence
        graph = graph_mode.StaticDecode(self.model, self.device, options, self.decode_step if whole else None)
        what = "whole decode step (forward, argmax, EOS flags, position and mask updates)" if whole \
            else "forward; the runner's own step hooks run around it"
        self.logger.info(f"{self.model_name} exe_mode graph: decode step compiled with torch.compile "
                         f"({graph.backend}) in the warm-up run, static KV cache; prefill eager; compiled: {what}")
        return graph

    def uses_base_step_hooks(self) -> bool:
        return (type(self).model_input_prepare is ModelRunner.model_input_prepare
                and type(self).model_output_process is ModelRunner.model_output_process)

    def new_cache(self, batch_size: int, max_cache_len: int):
        """The KV cache for one generation: in eager mode the one generate() starts with (None for a
        model that makes its own or carries its own state), in graph mode a StaticCache kept and
        reset between generations (engine.graph_mode)."""
        if self.graph is None:
            return generation_cache(self.model, self.traits)
        return self.graph.new_cache(batch_size, max_cache_len)

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
        rows = input_ids.shape[0]
        return {"input_ids": input_ids, "attention_mask": inputs["attention_mask"],
                "generate_ids": input_ids.new_zeros((rows, 0)),
                "finished": torch.zeros(rows, dtype=torch.bool, device=self.device),
                "cache": self.new_cache(rows, input_ids.shape[1] + self.max_new_tokens), "is_prefill": True}

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
            if self.traits.without_mask:
                attention_mask = None  # as the model's own step (mamba); the batch keeps the mask
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                        self.cache_kwarg: batch["cache"], "use_cache": True}
        if self.traits.logits_to_keep:
            model_inputs["logits_to_keep"] = 1  # only the last position's logits are needed
        return model_inputs

    def model_output_process(self, model_inputs: dict, outputs, batch: dict) -> None:
        """Greedy next tokens into `batch`; the mask, positions and cache move one step on. On the
        static buffers of graph mode (a `step` cursor in the batch) every update is in place."""
        next_tokens = outputs.logits[:, -1, :].argmax(dim=-1)
        finished = batch["finished"]
        # Finished requests keep receiving the pad token so the batch stays rectangular.
        next_tokens = torch.where(finished, torch.full_like(next_tokens, self.pad_token_id), next_tokens)
        finished = finished | torch.isin(next_tokens, self.eos_ids)
        if "step" in batch:
            batch["generate_ids"].index_copy_(1, batch["step"], next_tokens[:, None])
            batch["attention_mask"].index_fill_(1, batch["next_column"], 1)
            for key, value in (("finished", finished), ("next_tokens", next_tokens),
                               ("position_ids", model_inputs["position_ids"])):
                batch[key].copy_(value)
            batch["step"].add_(1)
            batch["next_column"].add_(1)
            return
        mask = batch["attention_mask"]
        batch.update(generate_ids=torch.cat([batch["generate_ids"], next_tokens[:, None]], dim=-1),
                     attention_mask=torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1),
                     finished=finished, next_tokens=next_tokens, position_ids=model_inputs["position_ids"],
                     is_prefill=False)
        # The model built its cache at prefill (its own class for hybrid models), or returned its
        # recurrent state under its own name (rwkv `state`, xlnet `mems`): keep it for the next step.
        returned = outputs.get(self.cache_kwarg, outputs.get("cache", outputs.get("past_key_values")))
        if returned is not None:
            batch["cache"] = returned

    def decode_step(self, batch: dict) -> None:
        """One decode step, the same in both exe_modes: the hooks around one forward (compiled whole,
        on static buffers, in graph mode with the base hooks: `decoding`)."""
        model_inputs = self.model_input_prepare(batch)
        if self.traits.full_sequence:
            model_inputs = full_sequence_inputs(model_inputs, batch)
        forward_inputs = step_inputs(self, model_inputs, batch)
        # The compiled forward only on the static cache: a runner's own dynamic cache changes shape each step.
        compiled = self.graph is not None and self.graph.step is None and batch.get("cache") is self.graph.cache
        outputs = self.graph.padded_forward(**forward_inputs) if compiled else self.model(**forward_inputs)
        self.model_output_process(model_inputs, outputs, batch)

    def decoding(self, batch: dict):
        """(the batch, the step) the decode loop runs: the compiled whole step on static buffers in graph
        mode with the base hooks, else `decode_step` on the batch as the prefill left it."""
        if self.graph is None or self.graph.step is None or batch.get("cache") is not self.graph.cache:
            return batch, self.decode_step
        return self.graph.static_batch(batch), self.graph.step

    def model_generate(self, prompts, warm_up=False, *built) -> list[str]:
        """Greedy generation for `prompts`; the texts. A runner that built its batch itself calls
        `model_generate(input_dict, input_lens, warm_up)`."""
        if isinstance(prompts, dict):
            return generate(self, prompts, warm_up=bool(built and built[0]))
        return generate(self, self.start_batch(prompts), warm_up)
