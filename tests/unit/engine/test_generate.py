"""engine/generate.py's loop without a host synchronize per step, on a scripted fake model.

The EOS flag is read every EOS_CHECK_EVERY steps, so the loop runs past EOS by fewer than that many
steps; the log lines and the tokens must still stop at the EOS step, exactly as a check after every
step would. StepTimer: perf_counter on CPU, one figure per start/stop pair.
"""

from __future__ import annotations

import logging
import time

import torch

from engine import generate as generate_module
from engine.model_runner import ModelRunner
from engine.timing import StepTimer
from engine.traits import StepTraits

EOS, PAD, VOCAB = 9, 0, 10


class ScriptedOutput(dict):
    def __init__(self, logits):
        super().__init__(logits=logits)
        self.logits = logits


class ScriptedModel:
    """Each call's greedy token is the next of `script` (rows: the batch)."""

    def __init__(self, script: list[list[int]]):
        self.script = script
        self.calls = 0

    def __call__(self, input_ids, **kwargs):
        tokens = [row[min(self.calls, len(row) - 1)] for row in self.script]
        self.calls += 1
        logits = torch.zeros(len(tokens), input_ids.shape[1], VOCAB)
        logits[torch.arange(len(tokens)), -1, torch.tensor(tokens)] = 1.0
        return ScriptedOutput(logits)


class FakeTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(t) for t in row if t not in (EOS, PAD)) for row in ids.tolist()]


def fake_runner(script, max_new_tokens=30):
    runner = ModelRunner.__new__(ModelRunner)  # the base hooks, no checkpoint
    runner.model = ScriptedModel(script)
    runner.model_name, runner.device, runner.max_new_tokens = "fake", torch.device("cpu"), max_new_tokens
    runner.logger = logging.getLogger("test_decode_loop")
    runner.tokenizer, runner.pad_token_id, runner.eos_ids = FakeTokenizer(), PAD, torch.tensor([EOS])
    runner.traits, runner.graph, runner.model_bytes, runner.parity_dump = StepTraits(), None, 1000, None
    return runner


def start_batch(rows: int) -> dict:
    ids = torch.ones((rows, 3), dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "generate_ids": ids.new_zeros((rows, 0)),
            "finished": torch.zeros(rows, dtype=torch.bool), "cache": None, "is_prefill": True}


def decode_lines(caplog) -> list[str]:
    return [r.message for r in caplog.records if "inference time cost of decode" in r.message]


def test_eos_read_every_k_steps_and_the_steps_past_it_dropped(caplog, monkeypatch):
    monkeypatch.setattr(generate_module, "EOS_CHECK_EVERY", 8)
    # Row 0 ends at decode step 3 (EOS is its 4th token), row 1 at decode step 5.
    runner = fake_runner([[1, 2, 3, EOS, 4, 4, 4], [5, 6, 7, 8, 8, EOS, 4]])
    caplog.set_level(logging.INFO, logger="test_decode_loop")
    texts = generate_module.generate(runner, start_batch(2))
    # The flag was read before decode steps 0 and 8: 1 prefill + 8 decode forwards ran ...
    assert runner.model.calls == 9
    # ... but the log and the tokens stop where every row had finished (decode step 5).
    assert len(decode_lines(caplog)) == 5
    assert runner.last_generate_ids.tolist() == [[1, 2, 3, EOS, PAD, PAD], [5, 6, 7, 8, 8, EOS]]
    assert texts == ["1 2 3", "5 6 7 8 8"]
    assert sum("inference time cost of prefill" in r.message for r in caplog.records) == 1


def test_without_eos_every_token_is_generated(caplog):
    runner = fake_runner([[1, 2, 3, 4]], max_new_tokens=12)
    caplog.set_level(logging.INFO, logger="test_decode_loop")
    generate_module.generate(runner, start_batch(1))
    assert runner.model.calls == 12 and len(decode_lines(caplog)) == 11
    assert runner.last_generate_ids.shape == (1, 12)


def test_eos_at_prefill_runs_no_decode_step(caplog):
    runner = fake_runner([[EOS, 1, 1]])
    caplog.set_level(logging.INFO, logger="test_decode_loop")
    generate_module.generate(runner, start_batch(1))
    assert runner.model.calls == 1 and decode_lines(caplog) == []
    assert runner.last_generate_ids.tolist() == [[EOS]]


def test_step_timer_on_cpu_times_each_pair():
    timer = StepTimer(torch.device("cpu"))
    for seconds in (0.02, 0.0, 0.05):
        timer.start()
        time.sleep(seconds)
        timer.stop()
    first, second, third = timer.elapsed_ms()
    assert 15 < first < 200 and second < 5 and 45 < third < 300
