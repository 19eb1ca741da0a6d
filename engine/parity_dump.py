"""The formal run's prompt and logits, left for the migrator's parity check (agent.measure.parity).

Set PARITY_DUMP_ENV to a file and the formal generation (never the warm-up) writes there, once it is
complete, the prompt, its last-position logits, the greedy tokens, and how well the weights predict
the prompt (untrained weights write noise by design). The reference model is compared against the
dump afterwards, so no process holds two models.
"""

from __future__ import annotations

import math
import os

from engine.safe_write import run_folder_tree

PARITY_DUMP_ENV = "MIGRATOR_PARITY_DUMP"


def wanted(warm_up: bool) -> bool:
    return not warm_up and bool(os.environ.get(PARITY_DUMP_ENV))


class ParityDump:
    """What the prefill left, kept until the generation has ended: the forwards the dump still needs
    must not run between two steps, where they would disturb a model that keeps its state in its
    modules (recurrent_gemma's forward without the cache clears its recurrent state)."""

    def __init__(self, model_inputs: dict, outputs):
        # `outputs` is None when the step's forward was not the prompt's (a model that builds its own
        # step: xlm predicts at an appended mask token); the prompt's logits are computed then.
        self.model_inputs = model_inputs
        self.logits = None if outputs is None else outputs.logits[:, -1, :].float().cpu()

    def save(self, runner, generate_ids) -> None:
        """The forwards over the prompt without the cache run after the timed loop, so no timing
        changes. Every rank runs them (with tensor parallel a forward is a collective); rank 0 writes."""
        import torch

        kwargs = {k: v for k, v in self.model_inputs.items()
                  if k not in (runner.cache_kwarg, "logits_to_keep", "use_cache")}

        def prompt_logits():
            with torch.inference_mode():
                return runner.model(**kwargs, use_cache=False).logits.float()

        full = prompt_logits() if self.logits is None else None
        dump = {"input_ids": self.model_inputs["input_ids"].cpu(),
                "attention_mask": self.model_inputs["attention_mask"].cpu(),
                "logits": self.logits if full is None else full[:, -1, :].cpu(),
                "dtype": str(runner.dtype).removeprefix("torch."), "device": runner.device.type,
                "generate_ids": generate_ids.cpu()}
        try:
            full = (prompt_logits() if full is None else full)[0, :-1]
            ids = self.model_inputs["input_ids"][0, 1:]
            dump["prompt_nll"] = torch.nn.functional.cross_entropy(full, ids).item()
            dump["uniform_nll"] = math.log(full.shape[-1])
        except Exception:  # noqa: BLE001 - the parity check then computes it itself
            pass
        if runner.rank == 0:
            # Written once, when the formal run is complete: a partial dump never exists.
            path = os.environ[PARITY_DUMP_ENV]      # in the run folder the migrator made and checked
            run_folder_tree(os.path.dirname(os.path.abspath(path))).write_with(
                path, lambda tmp: torch.save(dump, tmp))

