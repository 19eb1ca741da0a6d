"""Prefill context parallel of the generated dense attention (agent/recipe/native/parts/code/context_parallel.py and
attention_fused.py's _attention_cp), in process: upstream's own cp_metadata (executor/core/engine/execution_engine.py
_apply_prefill_cp, run as written on a stand-in engine) for packed prompts of unequal length at 2 and 4 CP ranks;
each rank's two segments through the generated method, under the stand-in's reference fused attention, the
ranks' keys and values gathered by a stand-in all_gather. Every real token's output equals a causal attention of
its whole prompt; each rank's cache holds exactly the requests the executor has it decode (request_cp_rank), at
their slots; and the gathered rows restore the batch's token order. A later segment attending over the earlier
segment's key range fails. End to end through upstream's launcher at 2 ranks (slow):
tests/e2e/test_context_parallel.py. Which files hold the part, and which switch table row refuses cp_size for the
others: test_the_part_is_in_dense_files_only here, and test_switches.py."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import sys
import types

import pytest
import torch

import native_moe_harness as harness

CTX = {"model_name": "tiny_cp", "framework_class": "TinyCpForCausalLM", "display_name": "cp",
       "model_class": "ForCausalLM", "transformers_version": "5.0.0"}
SHRUNK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
              intermediate_size=32, vocab_size=128)
LENGTHS = [13, 5, 1, 8]             # the packed prompts: unequal, one shorter than the segments it is padded to
BLOCK = 16
SLOTS_PER_REQUEST = 64
LATER_HALF = "(query[cp.local_prev_token_num:], cp.actual_seq_q_next, cp.kv_len_next)"


WINDOW = 4                          # mistral's sliding window, shrunk: shorter than the longest prompt


def generated(model_type: str) -> str:
    from transformers import AutoConfig

    from agent.recipe.native.assemble import write
    from agent.recipe.native.compose import derive

    return write(derive(AutoConfig.for_model(model_type).to_dict()), CTX)


@pytest.fixture(scope="module")
def source():
    return generated("llama")


@pytest.fixture(scope="module")
def windowed_source():
    """mistral's file: every layer in a sliding window where the config sets one (WINDOWS)."""
    return generated("mistral")


@contextlib.contextmanager
def cache_info_importable():
    """The generated file imports executor.core.kv_cache.cache_info, whose packages' __init__ import the engine
    (torch.npu at import): while it is imported, those packages are bare and cache_info.py (dataclasses, torch)
    is loaded alone."""
    names = ("executor.core", "executor.core.kv_cache", "executor.core.kv_cache.cache_info")
    saved = {name: sys.modules.get(name) for name in names}
    folder = harness.UPSTREAM / "executor" / "core"
    for name, path in zip(names[:2], (folder, folder / "kv_cache")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    spec = importlib.util.spec_from_file_location(names[2], folder / "kv_cache" / "cache_info.py")
    sys.modules[names[2]] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(sys.modules[names[2]])
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def upstream_cp_metadata(cp_size: int, rank: int, lengths: list[int], slot_mapping: dict):
    """upstream's ExecutionEngine._apply_prefill_cp, its source as the snapshot has it, on an engine of the
    fields it reads: (global padded input ids, their positions, cp_metadata) of rank `rank`."""
    from executor.utils.forward_metadata import PrefillCPMetaData

    path = harness.UPSTREAM / "executor" / "core" / "engine" / "execution_engine.py"
    tree = ast.parse(path.read_text())
    function = next(node for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef) and node.name == "_apply_prefill_cp")
    namespace = {"torch": torch, "PrefillCPMetaData": PrefillCPMetaData, "Optional": __import__("typing").Optional,
                 "Dict": dict, "Batch": object}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(path), "exec"), namespace)
    parallel = types.SimpleNamespace(cp_size=cp_size, global_rank=rank, attn_tp_size=1)
    engine = types.SimpleNamespace(
        infer_config=types.SimpleNamespace(parallel_config=parallel,
                                           disagg_config=types.SimpleNamespace(disaggregation_mode="NONE")),
        exe_mode="eager", world_size=cp_size, global_rank=rank, device="cpu", block_size=BLOCK,
        main_worker=types.SimpleNamespace(model=object()))
    ids = torch.arange(1, sum(lengths) + 1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    table = {"FullAttention": torch.zeros(len(lengths), 4, dtype=torch.int32)}
    return namespace["_apply_prefill_cp"](engine, ids, positions, torch.tensor(lengths), table, slot_mapping)


def whole_prompt_attention(q, k, v, scale, window=None):
    """Causal attention of one whole prompt, [T, heads, D] with the key heads shared by query-head groups; in a
    sliding window, a query at i sees keys i - window + 1 .. i (transformers' window)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    hidden = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    if window:
        hidden |= torch.ones_like(hidden).tril(-window)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def run_ranks(source: str, cp_size: int, model_type: str = "llama", window: int | None = None):
    """Each CP rank's generated _attention_cp on upstream's metadata: (the worst |out - whole-prompt attention|
    over every real token, each rank's cache rows {slot: key row} and the slots the executor has it keep, the
    gathered rows' order)."""
    harness.ensure_imports()
    with cache_info_importable():
        module = harness.load_generated(source, f"cp_{cp_size}_{abs(hash(source)) % 10**8}")
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **SHRUNK, **({"sliding_window": window} if window else {}))
    infer_config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(world_size=cp_size, attn_tp_size=1, cp_size=cp_size),
        model_config=types.SimpleNamespace(exe_mode="eager"), scheduler_config=types.SimpleNamespace(block_size=BLOCK))
    comm = types.SimpleNamespace(get_group=lambda name: name, get_rank=lambda name: 0)
    attention = module.TinyCpAttention(config, infer_config, comm, 0)
    heads, kv_heads, dim = 4, 2, 16
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    # request i's token t lives at slot i * SLOTS_PER_REQUEST + t (the executor's persistent slot mapping)
    slots = torch.cat([torch.arange(n) + i * SLOTS_PER_REQUEST for i, n in enumerate(LENGTHS)])
    kind = "SlidingWindow" if window else "FullAttention"
    assert attention.attn_type == kind
    metas = [upstream_cp_metadata(cp_size, r, LENGTHS, {kind: slots})[2] for r in range(cp_size)]
    padded = metas[0].global_padded_token_num
    gen = torch.Generator().manual_seed(cp_size)
    q = torch.randn(padded, heads, dim, generator=gen)
    k, v = torch.randn(padded, kv_heads, dim, generator=gen), torch.randn(padded, kv_heads, dim, generator=gen)
    valid = metas[0].global_valid_indices

    def all_gather(parts, local, group=None):
        assert group == "cp_group"
        source_rows = next(t for t in (k, v) if torch.equal(t[metas[rank].local_indices], local))
        for r, part in enumerate(parts):
            part.copy_(source_rows[metas[r].local_indices])

    module.dist = types.SimpleNamespace(all_gather=all_gather)
    mask = ~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))
    got = torch.zeros(padded, heads, dim)
    caches = []
    for rank in range(cp_size):
        meta = metas[rank]
        attention.k_cache = torch.zeros(len(LENGTHS) * SLOTS_PER_REQUEST // BLOCK, BLOCK, kv_heads * dim)
        attention.v_cache = torch.zeros_like(attention.k_cache)
        metadata = types.SimpleNamespace(is_prefill=True, cp_metadata=meta, attention_mask=mask)
        out = attention._attention_cp(q[meta.local_indices], k[meta.local_indices], v[meta.local_indices], metadata)
        got[meta.local_indices] = out.reshape(-1, heads, dim)
        written = attention.k_cache.view(-1, kv_heads, dim)
        kept = {int(s): written[s] for s in range(written.shape[0]) if written[s].any()}
        caches.append((kept, meta.output_request_indices.tolist()))
    worst = 0.0
    for i, (start, n) in enumerate(zip(starts, LENGTHS)):
        rows = valid[start:start + n]
        want = whole_prompt_attention(q[rows], k[rows], v[rows], attention.scaling, window)
        worst = max(worst, float((got[rows] - want).abs().max()))
    hidden = torch.randn(padded, 8, generator=gen)
    rank = 0
    module.dist = types.SimpleNamespace(all_gather=lambda parts, local, group=None: [
        part.copy_(hidden[metas[r].local_indices]) for r, part in enumerate(parts)])
    restored = module.gather_cp(hidden[metas[0].local_indices], metas[0], "cp_group")
    return worst, caches, (k, valid, starts, slots), torch.equal(restored, hidden)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_each_ranks_segments_attend_as_the_whole_prompt_and_it_keeps_its_own_requests(source, cp_size):
    worst, caches, (k, valid, starts, slots), restored = run_ranks(source, cp_size)
    assert worst < 1e-5, worst
    assert restored
    for rank, (kept, owned) in enumerate(caches):
        # the executor's request_cp_rank (no batch: request i on rank i % cp_size)
        assert owned == [i for i in range(len(LENGTHS)) if i % cp_size == rank], owned
        want = {int(slots[start + t]): k[valid[start + t]] for i in owned
                for start, t in ((starts[i], t) for t in range(LENGTHS[i]))}
        assert set(kept) == set(want), (rank, sorted(kept), sorted(want))
        assert all(torch.equal(kept[s], want[s]) for s in want)


def test_a_sliding_window_layer_attends_its_band_over_the_gathered_keys(windowed_source):
    """A sliding-window layer (mistral's, window 4 over prompts of up to 13 tokens): each segment's queries see
    the window's keys, some on another rank; the band's fault (the whole causal range) is caught."""
    worst, _, _, _ = run_ranks(windowed_source, 2, "mistral", WINDOW)
    assert worst < 1e-5, worst
    band = '{"sparse_mode": 4, "pre_tokens": self.sliding_window - 1, "next_tokens": 0}'
    assert windowed_source.count(band) == 1
    worst, _, _, _ = run_ranks(windowed_source.replace(band, '{"sparse_mode": 3}'), 2, "mistral", WINDOW)
    assert worst > 1e-2, worst


def test_a_segment_attending_over_the_wrong_keys_is_caught(source):
    """The later segment given the earlier segment's key range (kv_len_prev)."""
    assert source.count(LATER_HALF) == 1
    worst, _, _, _ = run_ranks(source.replace(LATER_HALF, LATER_HALF.replace("kv_len_next", "kv_len_prev")), 2)
    assert worst > 1e-2, worst


def test_the_part_is_in_dense_files_only(source):
    """The dense fused attention reads the executor's segments; a model with sparse-MoE layers does not (no
    cp_metadata read), so preflight refuses cp_size for it (test_switches.py) and so does its file's own guard."""
    from transformers import AutoConfig

    from agent.recipe.native.assemble import write
    from agent.recipe.native.compose import derive
    from agent.recipe.native.preflight import names_read

    assert "cp_metadata" in names_read(source) and "cp_group" in names_read(source)
    moe = write(derive(AutoConfig.for_model("qwen3_moe").to_dict()), CTX)
    assert not {"cp_metadata", "cp_group", "CONTEXT_PARALLEL"} & names_read(moe)
    # the file's own guard, for a YAML run without the migrator: cp_size refused where the attention does not read it
    config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=48)
    for text, refused in ((source, False), (moe, True)):
        function = next(node for node in ast.parse(text).body
                        if isinstance(node, ast.FunctionDef) and node.name == "check_parallel")
        namespace: dict = {}
        exec(compile(ast.Module([function], []), "check_parallel", "exec"), namespace)    # noqa: S102 - our render
        parallel = types.SimpleNamespace(world_size=2, attn_tp_size=1, lmhead_tp_size=1, moe_tp_size=1, cp_size=2)
        if refused:
            with pytest.raises(ValueError, match="cp_size 2: .* set parallel_config.cp_size to 1"):
                namespace["check_parallel"](config, parallel)
        else:
            namespace["check_parallel"](config, parallel)
        namespace["check_parallel"](config, types.SimpleNamespace(**{**vars(parallel), "cp_size": 1}))


def test_the_precision_record_holds_each_ranks_own_requests(tmp_path, monkeypatch):
    """The per-step record of a context-parallel prefill (agent.measure.precision_probe, around upstream's
    ModelWorker.inference): every rank's model returns the whole batch's logits and the executor samples the
    requests the rank decodes (output_request_indices), so the record holds those requests' prompts without the
    padding, their rows of the logits, and no layers (a rank's layers saw only its segments)."""
    from agent.measure import precision_probe as probe

    harness.ensure_imports()
    captured = {}
    # the record as torch.save would write it, through the probe's own write path
    folder = types.SimpleNamespace(write_with=lambda path, write: write(path))
    monkeypatch.setattr(probe, "_safe_write", lambda: types.SimpleNamespace(
        run_folder_tree=lambda *args, **kwargs: folder))
    monkeypatch.setattr(torch, "save", lambda record, path: captured.update(record))
    monkeypatch.setitem(probe._state, "dir", str(tmp_path))
    monkeypatch.setitem(probe._state, "calls", 0)
    monkeypatch.setitem(probe._state, "worker", True)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for rank in range(2):
        ids, positions, cp = upstream_cp_metadata(2, rank, LENGTHS, None)
        metadata = types.SimpleNamespace(is_prefill=True, cp_metadata=cp,
                                         actual_seq_lengths_cu_q=torch.tensor(LENGTHS).cumsum(0))
        logits = torch.arange(len(LENGTHS), dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 5).clone()

        def inference(self, model_inputs, is_prefill, layer_rows=cp.local_token_num):
            probe._state["current"]["layers"][0] = torch.zeros(layer_rows, 3)     # a layer saw only its segments
            return logits

        probe._wrap_inference(inference)(None, {"input_ids": ids, "forward_metadata": metadata}, True)
        record = captured
        owned = [i for i in range(len(LENGTHS)) if i % 2 == rank]
        prompts = [list(range(starts[i] + 1, starts[i] + LENGTHS[i] + 1)) for i in owned]
        assert record["input_ids"].tolist() == sum(prompts, [])
        assert record["seq_ends"] == [sum(LENGTHS[i] for i in owned[:k + 1]) for k in range(len(owned))]
        assert record["rows"] == len(owned) and record["logits"][:, 0].tolist() == [float(i) for i in owned]
        assert record["layers"] is None
