"""The generate loop, as plain as gpt-fast's generate.py:

    prefill (the prompt, eager) -> decode steps ... -> every row at EOS, or max_new_tokens

`runner` is the recipe's ModelRunner. One step is its two hooks around one forward:
`model_input_prepare(batch)` (the forward's kwargs) and `model_output_process(model_inputs,
outputs, batch)` (the next tokens into `batch`, the generation's state: a dict of tensors, so a
runner may override either hook). A decode step is `runner.decode_step(batch)`, eager or, in graph
mode with the base hooks, compiled whole on static buffers (`runner.decoding`, engine.graph_mode).

Each step is timed by device events (engine.timing.StepTimer), read after the loop, and logged then
as "{model_name} inference time cost of prefill|decode is X ms"; the texts as "Request N: outputs: ...".
"""

from __future__ import annotations

from engine import environment, parity_dump
from engine.timing import StepTimer
from engine.traits import generation_cache

torch = environment.import_torch()  # through the guard: see engine.environment.import_torch

# How often the host reads the "every row finished" flag: each read waits for the device, so the
# loop reads it every EOS_CHECK_EVERY steps and drops the steps run past EOS afterwards.
EOS_CHECK_EVERY = 8


@torch.inference_mode()
def prefill(runner, batch: dict, warm_up: bool) -> None:
    """The prompt's step, eager in both exe_modes; its inputs and logits are the parity dump's."""
    model_inputs = runner.model_input_prepare(batch)
    forward_inputs = step_inputs(runner, model_inputs, batch)
    outputs = runner.model(**forward_inputs)
    if parity_dump.wanted(warm_up):
        runner.parity_dump = parity_dump.ParityDump(model_inputs, outputs if forward_inputs is model_inputs else None)
    runner.model_output_process(model_inputs, outputs, batch)


@torch.inference_mode()
def decode_one_token(step, batch: dict) -> None:
    step(batch)


def generate(runner, batch: dict, warm_up: bool = False) -> list[str]:
    """Greedy generation: prefill, then one decode step per token, each step timed.

    No host synchronize per step: the steps are timed by device events (StepTimer) and the EOS
    flag is read every EOS_CHECK_EVERY steps; the timing lines are logged after the loop, for the
    steps up to the one where every row had finished (the steps run past it are dropped, so the
    log and the tokens are the same as with a check after every step)."""
    name = runner.model_name
    if warm_up:
        runner.logger.info(f"{name} warm-up run begins")
    timer = StepTimer(runner.device)
    timer.start()
    prefill(runner, batch, warm_up)
    timer.stop()
    batch, step = runner.decoding(batch)
    all_finished = [batch["finished"].all()]  # after prefill, then after each decode step: device flags
    steps = 0
    while steps < runner.max_new_tokens - 1:
        if steps % EOS_CHECK_EVERY == 0 and bool(all_finished[-1]):
            break
        timer.start()
        decode_one_token(step, batch)
        timer.stop()
        all_finished.append(batch["finished"].all())
        steps += 1

    step_ms = timer.elapsed_ms()  # the one synchronize of the loop
    # Steps past the first one after which every row had finished only added pad tokens: drop them.
    done = torch.stack(all_finished).tolist()
    steps = done.index(True) if True in done else steps
    # A copy: in graph mode the ids are a buffer the next generation reuses.
    generate_ids = batch["generate_ids"][:, :steps + 1].clone()
    runner.logger.info(f"{name} inference time cost of prefill is {step_ms[0]:.2f} ms")
    decode_ms = step_ms[1:steps + 1]
    for ms in decode_ms:
        runner.logger.info(f"{name} inference time cost of decode is {ms:.2f} ms")
    return finish_generation(runner, generate_ids, decode_ms, warm_up)


def finish_generation(runner, generate_ids, decode_ms: list[float], warm_up: bool) -> list[str]:
    """Log the texts and the decode rate; after the formal run, write the parity dump."""
    name = runner.model_name
    runner.last_generate_ids = generate_ids
    texts = runner.tokenizer.batch_decode(generate_ids, skip_special_tokens=True)
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
        dump, runner.parity_dump = runner.parity_dump, None
        dump.save(runner, generate_ids)
    return texts


def step_inputs(runner, model_inputs: dict, batch: dict) -> dict:
    """The forward's kwargs: the runner's, or for a model that builds its own step, what its
    `prepare_inputs_for_generation` builds from the whole sequence, as `generate()` feeds it."""
    if not runner.traits.builds_own_step:
        return model_inputs
    if batch["is_prefill"] and batch["cache"] is None:
        # Such a forward need not return its cache (xlm's does not): generate()'s, filled in place.
        batch["cache"] = generation_cache(runner.model, runner.traits)
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
