"""The native file against transformers before it is written: `python -m agent.recipe.native.selfcheck JOB.json`
under the npu stand-in (torch_npu's ops are its reference kernels), a cann-recipes-infer checkout on
sys.path (module.linear, executor.*).

For each job: transformers' model on the shrunk config (agent.recipe.native.features.shrunk_config,
random weights, float32, eager) and the generated file's ForCausalLM with the same weights, through
the executor's contract as its ModelWorker drives it: a packed prefill of prompts of unequal length,
then decode steps, on a paged cache of small blocks whose sliding-window tables point the blocks before
the window at the null block, and every table's padding too, as upstream's SlidingWindowManager and
prepare_block_tables do. The null block holds NaN before every step (the positions before a window are
written there): a step that reads it, even masked, fails (the reference kernels sum 0 x NaN), so a
decode reads what it attends to — its window's blocks, its own length — or it fails. Every step's
logits are compared with transformers' on the same tokens. Prints one JSON line: per job {"ok",
"max_rel", "reason"}.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import traceback
from types import SimpleNamespace

from engine.safe_load import load_json

BLOCK_SIZE = 4
PROMPT_LENGTHS = (13, 6, 3)     # the shrunk window is 5: one prompt past it, one reaching it, one short of it
DECODE_STEPS = 5
TOLERANCE = 1e-4            # relative to the largest logit: float32 against float32


def _infer_config(block_size: int, exe_mode: str = "eager"):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=1, attn_tp_size=1, lmhead_tp_size=1, moe_tp_size=1, embed_tp_size=1),
        model_config=SimpleNamespace(exe_mode=exe_mode, enable_weight_nz=False),
        scheduler_config=SimpleNamespace(block_size=block_size))


class _SingleRank:
    def register_group(self, **kwargs):
        return None

    def get_rank(self, name):
        return 0

    def get_group(self, name):
        return None


def _import(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class PagedTables:
    """Block tables and slot mappings of one cache kind, as upstream's managers build them: a full
    table holds every block of a sequence; a sliding-window one (window W) points the blocks before
    the window (first kept token: last - W) at the null block 0 when the prefill allocates them."""

    def __init__(self, window, block_size, lengths):
        self.window, self.block_size = window, block_size
        self.next_block, self.rows = 1, []
        for length in lengths:
            total = -(-length // block_size)
            first = max(0, length - 1 - window) // block_size if window else 0
            row = [0] * first + list(range(self.next_block, self.next_block + total - first))
            self.next_block += total - first
            self.rows.append(row)

    def grow(self, lengths):
        for row, length in zip(self.rows, lengths):
            while len(row) * self.block_size < length:
                row.append(self.next_block)
                self.next_block += 1

    def table(self, width):
        import torch

        return torch.tensor([row + [0] * (width - len(row)) for row in self.rows], dtype=torch.int32)

    def slots(self, row, positions):
        import torch

        return torch.tensor([self.rows[row][p // self.block_size] * self.block_size + p % self.block_size
                             for p in positions], dtype=torch.int64)


def check(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from agent.recipe.native.features import shrunk_config
    from executor.utils.forward_metadata import ForwardMetaData

    torch.set_default_dtype(torch.float32)
    config = shrunk_config(job["config"])
    torch.manual_seed(job.get("seed", 0))
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    module = _import(job["file"], f"native_selfcheck_{job.get('index', 0)}")
    model_class = getattr(module, job["class_name"])
    native_config = shrunk_config(job["config"])
    model = model_class(native_config, _infer_config(BLOCK_SIZE), _SingleRank(), "").eval()
    loaded = model.load_weights(reference.state_dict().items())
    missing = sorted(set(dict(model.named_parameters())) - set(loaded))
    if missing:
        return {"ok": False, "max_rel": None, "reason": f"parameters no checkpoint tensor loaded: {missing[:4]}"}
    model.process_weights_after_loading()
    # the paged cache: [blocks, block_size, kv heads, dim]; block 0 (the null block) holds NaN
    lengths = list(PROMPT_LENGTHS)
    final = [n + DECODE_STEPS for n in lengths]
    width = max(-(-n // BLOCK_SIZE) for n in final)
    blocks = len(lengths) * width + 2
    generator = torch.Generator().manual_seed(7)
    entries = [entry for info in model.get_cache_info().layer_infos for entry in info.caches]
    caches = []
    for entry in entries:
        caches.append(torch.zeros(blocks, BLOCK_SIZE, entry.num_head, entry.dim, dtype=entry.dtype))
        entry.tensor_setter(caches[-1])

    def poison_null_block():
        # every sequence's positions before its window are written to the null block (upstream's
        # prepare_slot_mapping), so it holds anything: NaN before each step
        for cache in caches:
            cache[0] = float("nan")
    kinds = {entry.attn_type: entry.sliding_window for entry in entries}
    tables = {kind: PagedTables(window, BLOCK_SIZE, lengths) for kind, window in kinds.items()}
    vocab = config.vocab_size
    sequences = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    mask = ~torch.tril(torch.ones((2048, 2048), dtype=torch.bool))
    worst = 0.0

    def compare(step, logits):
        nonlocal worst
        for row, tokens in enumerate(sequences):
            with torch.no_grad():
                expected = reference(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].float()
            got = logits[row].reshape(-1)
            rel = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))
            if not math.isfinite(rel):
                rel = float("inf")
            worst = max(worst, rel)
            if rel > TOLERANCE:
                raise AssertionError(f"{step}, sequence {row} ({len(tokens)} tokens): logits differ from "
                                     f"transformers' by {rel:.2e} of the largest (> {TOLERANCE:g})")
        return [int(torch.argmax(logits[row].reshape(-1))) for row in range(len(sequences))]

    # packed prefill
    ids = torch.tensor([t for seq in sequences for t in seq])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int64)
    kv = torch.tensor(lengths, dtype=torch.int64)
    meta = ForwardMetaData(
        is_prefill=True, attention_mask=mask, actual_seq_lengths_kv=kv, actual_seq_lengths_cu_q=cu,
        actual_seq_lengths_q=kv.clone(), prompt_tokens=int(cu[-1]),
        block_table={k: t.table(width) for k, t in tables.items()},
        slot_mapping={k: torch.cat([t.slots(r, range(n)) for r, n in enumerate(lengths)]) for k, t in tables.items()})
    poison_null_block()
    with torch.no_grad():
        logits = model(ids, positions, meta)
    next_tokens = compare("prefill", logits)
    for step in range(DECODE_STEPS):
        for seq, token in zip(sequences, next_tokens):
            seq.append(token)
        lengths = [len(s) for s in sequences]
        for t in tables.values():
            t.grow(lengths)
        kv = torch.tensor(lengths, dtype=torch.int64)
        rows = len(sequences)
        meta = ForwardMetaData(
            is_prefill=False, attention_mask=mask, actual_seq_lengths_kv=kv,
            actual_seq_lengths_cu_q=torch.arange(1, rows + 1, dtype=torch.int64),
            actual_seq_lengths_q=torch.ones(rows, dtype=torch.int64),
            actual_seq_lengths_list_kv=lengths, actual_seq_lengths_cu_list_q=list(range(1, rows + 1)),
            block_table={k: t.table(width) for k, t in tables.items()},
            slot_mapping={k: torch.cat([t.slots(r, [n - 1]) for r, n in enumerate(lengths)]) for k, t in tables.items()})
        poison_null_block()
        with torch.no_grad():
            logits = model(torch.tensor(next_tokens), torch.tensor([n - 1 for n in lengths]), meta)
        next_tokens = compare(f"decode step {step + 1}", logits)
    return {"ok": True, "max_rel": worst, "reason": None}


def main(argv: list[str]) -> int:
    jobs = load_json(argv[0])
    results = []
    for index, job in enumerate(jobs):
        job.setdefault("index", index)
        try:
            results.append(check(job))
        except AssertionError as exc:
            results.append({"ok": False, "max_rel": None, "reason": str(exc)})
        except Exception as exc:  # noqa: BLE001 - any failure of the generated file is a reason to fall back
            last = traceback.extract_tb(exc.__traceback__)[-1]
            results.append({"ok": False, "max_rel": None,
                            "reason": f"{type(exc).__name__}: {exc} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"})
    print("SELFCHECK " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
