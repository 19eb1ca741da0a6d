"""The generate loop, as plain as gpt-fast's generate.py:

    prefill (the prompt, eager) -> decode_one_token ... -> every row at EOS, or max_new_tokens

`runner` is the recipe's ModelRunner: it holds the model and the two hooks of one step,
`model_input_prepare(batch)` (the forward's kwargs) and `model_output_process(model_inputs,
outputs, batch)` (the next tokens into `batch`). `batch` is the generation's state, a dict of
tensors (ModelRunner.start_batch); a dict because runners rendered before the engine owned the
loop build and read it by key. A model whose own generation step feeds it other tokens than the
sequence's (xlm appends its mask token) is stepped with its `prepare_inputs_for_generation`
(`step_inputs`); the hooks still keep the batch's state. What one step hands the next is asked of
the model too: the cache generate() would start it with (`generation_cache`), then what its forward
returns under its own cache argument (`cache_argument`: a Cache, rwkv's `state`, xlnet's `mems`).

Each forward is timed by device events (engine.timing.StepTimer), read after the loop, and logged
then as "{model_name} inference time cost of prefill|decode is X ms"; the texts as
"Request N: outputs: ...". In graph mode with the base hooks a decode step is one compiled call,
`runner.decode_step` on static buffers (ModelRunner.start_static_decode).
"""

from __future__ import annotations

import os

from engine import environment
from engine.timing import StepTimer

torch = environment.import_torch()  # through the guard: see engine.environment.import_torch

# Set by the migrator's trial run: where the formal run leaves its prompt logits for the parity check.
PARITY_DUMP_ENV = "MIGRATOR_PARITY_DUMP"


@torch.inference_mode()
def prefill(runner, model_inputs: dict):
    """The prompt's forward: eager in both exe_modes."""
    return runner.model(**model_inputs)


@torch.inference_mode()
def decode_one_token(runner, model_inputs: dict):
    """One decode forward through `decode_forward` (compiled in graph mode)."""
    if runner.decode_forward is runner.model or model_inputs.get(runner.cache_kwarg) is not runner.static_cache:
        # Eager, or a runner that made its own (dynamic) cache: shapes change every step.
        return runner.model(**model_inputs)
    # The 2D mask grows by one column per step; pad it to the cache length (the model would pad
    # it the same way) so the compiled step sees one shape.
    mask = model_inputs["attention_mask"]
    if mask is None:  # a model whose step takes none (mamba)
        return runner.decode_forward(**model_inputs)
    pad = runner.static_cache_shape[1] - mask.shape[-1]
    return runner.decode_forward(**{**model_inputs, "attention_mask": torch.nn.functional.pad(mask, (0, pad))})


# How often the host reads the "every row finished" flag: each read waits for the device, so the
# loop reads it every EOS_CHECK_EVERY steps and drops the steps run past EOS afterwards.
EOS_CHECK_EVERY = 8


@torch.inference_mode()
def decode_static_step(runner, state: dict) -> None:
    """One decode step, forward to mask update, in the compiled `runner.decode_step`."""
    runner.compiled_decode_step(state)


def generate(runner, batch: dict, warm_up: bool = False) -> list[str]:
    """Greedy generation: prefill, then one decode step per token, each forward timed.

    No host synchronize per step: the forwards are timed by device events (StepTimer) and the
    EOS flag is read every EOS_CHECK_EVERY steps; the timing lines are logged after the loop, for
    the steps up to the one where every row had finished (the steps run past it are dropped, so
    the log and the tokens are the same as with a check after every step)."""
    name = runner.model_name
    if warm_up:
        runner.logger.info(f"{name} warm-up run begins")
    timer = StepTimer(runner.device)
    model_inputs = runner.model_input_prepare(batch)
    forward_inputs = step_inputs(runner, model_inputs, batch)
    timer.start()
    outputs = prefill(runner, forward_inputs)
    timer.stop()
    if not warm_up and os.environ.get(PARITY_DUMP_ENV):
        # A step that is not the prompt's forward: the dump computes the prompt's logits itself.
        runner.dump_prefill(model_inputs, outputs if forward_inputs is model_inputs else None)
    runner.model_output_process(model_inputs, outputs, batch)

    static_state = runner.start_static_decode(batch)
    all_finished = [batch["finished"].all()]  # after prefill, then after each decode step: device flags
    steps = 0
    while steps < runner.max_new_tokens - 1:
        if steps % EOS_CHECK_EVERY == 0 and bool(all_finished[-1]):
            break
        if static_state is not None:  # graph mode, base hooks: the whole step is one compiled call
            timer.start()
            decode_static_step(runner, static_state)
            timer.stop()
        else:
            model_inputs = runner.model_input_prepare(batch)
            if runner.decode_full_sequence:
                model_inputs = full_sequence_inputs(model_inputs, batch)
            forward_inputs = step_inputs(runner, model_inputs, batch)
            timer.start()
            outputs = decode_one_token(runner, forward_inputs)
            timer.stop()
            runner.model_output_process(model_inputs, outputs, batch)
        all_finished.append(batch["finished"].all())
        steps += 1

    step_ms = timer.elapsed_ms()  # the one synchronize of the loop
    # Steps past the first one after which every row had finished only added pad tokens: drop them.
    done = torch.stack(all_finished).tolist()
    steps = done.index(True) if True in done else steps
    # A copy: in graph mode the ids are a buffer the next generation reuses.
    batch["generate_ids"] = batch["generate_ids"][:, :steps + 1].clone()
    runner.logger.info(f"{name} inference time cost of prefill is {step_ms[0]:.2f} ms")
    decode_ms = step_ms[1:steps + 1]
    for ms in decode_ms:
        runner.logger.info(f"{name} inference time cost of decode is {ms:.2f} ms")
    return finish_generation(runner, batch, decode_ms, warm_up)


def finish_generation(runner, batch: dict, decode_ms: list[float], warm_up: bool) -> list[str]:
    """Log the texts and the decode rate; after the formal run, write the parity dump."""
    name = runner.model_name
    runner.last_generate_ids = batch["generate_ids"]
    texts = runner.tokenizer.batch_decode(batch["generate_ids"], skip_special_tokens=True)
    for i, text in enumerate(texts):
        runner.logger.info(f"Request {i}: outputs: {text}")
    if len(decode_ms) > 1:
        # Every decode step reads all weights once: bytes / time = achieved bandwidth.
        per_token_s = sum(decode_ms[1:]) / len(decode_ms[1:]) / 1000
        runner.logger.info(f"{name} decode {1 / per_token_s:.1f} steps/s x batch {len(texts)}, "
                           f"achieved bandwidth {runner.model_bytes / per_token_s / 1e9:.2f} GB/s")
    if warm_up:
        runner.logger.info(f"{name} warm-up run ends")
    elif runner.parity_dump is not None:
        runner.save_parity_dump(batch["generate_ids"])
    return texts


def step_inputs(runner, model_inputs: dict, batch: dict) -> dict:
    """The forward's kwargs: the runner's, or for a model that builds its own step, what its
    `prepare_inputs_for_generation` builds from the whole sequence, as `generate()` feeds it."""
    if not getattr(runner, "model_builds_step", False):
        return model_inputs
    if batch["is_prefill"] and batch["cache"] is None:
        # Such a forward need not return its cache (xlm's does not): generate()'s, filled in place.
        batch["cache"] = generation_cache(runner.model, runner.cache_kwarg)
    input_ids = torch.cat([batch["input_ids"], batch["generate_ids"]], dim=-1)
    return runner.model.prepare_inputs_for_generation(
        input_ids, attention_mask=model_inputs["attention_mask"], use_cache=True,
        is_first_iteration=batch["is_prefill"], **{runner.cache_kwarg: batch["cache"]})


def full_sequence_inputs(model_inputs: dict, batch: dict) -> dict:
    """A decode step's inputs with the whole sequence so far (prompt + generated tokens)."""
    input_ids = torch.cat([batch["input_ids"], batch["generate_ids"]], dim=-1)
    mask = model_inputs["attention_mask"]
    position_ids = mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(mask == 0, 1)
    return {**model_inputs, "input_ids": input_ids, "position_ids": position_ids}


def wants_full_sequence(model) -> bool:
    """True when the model's own generation step feeds it the whole sequence, not the new token.

    Asked of the model's `prepare_inputs_for_generation` (what `generate()` calls each step): most
    slice `input_ids` to the token not yet in the cache; a model without a KV cache (openai-gpt)
    or one whose forward slices off the cached prefix itself (cpmant) keeps all of them.
    """
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return False
    ids = torch.ones((1, 3), dtype=torch.long)
    try:
        inputs = prepare(ids, next_sequence_length=1, attention_mask=torch.ones_like(ids), use_cache=True)
    except Exception:  # noqa: BLE001 - an unusual signature: keep the one-token step
        return False
    got = inputs.get("input_ids") if isinstance(inputs, dict) else None
    return got is not None and got.shape[-1] == ids.shape[-1]


def decodes_without_mask(model) -> bool:
    """True when the model's own generation step gives a decode step no attention mask: mamba's
    mixer multiplies the new token's states by the mask it is given, which would broadcast the one
    token over the whole sequence's mask."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return False
    ids = torch.ones((1, 3), dtype=torch.long)
    try:
        inputs = prepare(ids, next_sequence_length=1, attention_mask=torch.ones_like(ids), use_cache=True,
                         is_first_iteration=False)
    except Exception:  # noqa: BLE001 - an unusual signature: keep the mask
        return False
    return isinstance(inputs, dict) and "attention_mask" in inputs and inputs["attention_mask"] is None


def builds_own_step(model) -> bool:
    """True when the model's `prepare_inputs_for_generation` feeds it tokens that are not the
    sequence's (xlm appends its mask token and predicts there): the runner then builds each step
    with it (`step_inputs`) instead of its own hooks."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return False
    ids = torch.arange(3, dtype=torch.long)[None] + 1
    try:
        inputs = prepare(ids, next_sequence_length=1, attention_mask=torch.ones_like(ids), use_cache=True)
    except Exception:  # noqa: BLE001 - an unusual signature: keep the runner's step
        return False
    got = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if got is None or got.shape[0] != 1 or got.shape[-1] == 0:
        return False
    # Most return the whole sequence or its tail; anything else is the model's own input.
    return got.shape[-1] > ids.shape[-1] or not torch.equal(got[0], ids[0, -got.shape[-1]:])


# What one step hands the next, by the names transformers' generate() carries it under: a Cache
# (`cache`; `past_key_values` in code older than transformers 5), or a model's own state, returned
# by each forward (generation.utils.DEPRECATED_CACHE_NAMES: rwkv `state`, xlnet `mems`, reformer's).
CACHE_CLASS_NAMES = ("cache", "past_key_values")
CACHE_NAMES = (*CACHE_CLASS_NAMES, "state", "mems", "past_buckets_states")


def cache_argument(forward_params) -> str:
    """The forward's argument for the cache, as the model's own signature names it;
    `past_key_values` for a forward that names none (it may take it through **kwargs)."""
    return next((name for name in CACHE_NAMES if name in forward_params), "past_key_values")


def generation_cache(model, cache_kwarg: str):
    """The cache transformers' generate() starts a generation with: a DynamicCache of the model's
    text config, which the forward fills in place whether or not it returns it (xlm's and
    recurrent_gemma's do not); None for a model that carries its own state under another name
    (rwkv `state`, xlnet `mems`) or says it makes its own cache (`_supports_default_dynamic_cache`)."""
    supports_default = getattr(model, "_supports_default_dynamic_cache", None)
    if cache_kwarg not in CACHE_CLASS_NAMES or (supports_default is not None and not supports_default()):
        return None
    from transformers.cache_utils import DynamicCache

    config = model.config
    return DynamicCache(config=config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config)
