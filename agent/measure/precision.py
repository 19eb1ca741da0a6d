"""The precision check: one verdict for every recipe kind, per step, teacher-forced.

The recipe's own processes record what their model computed at every step (agent.measure.
precision_probe: each rank's prefill and decode calls, the logits of each request's last position
and every decoder layer's hidden states). From that record each request's prompt and tokens are
read back (the tokens are the recipe's greedy picks, each checked against the token the recipe fed
to its next step), and transformers' own model of the checkpoint — the recipe's pinned release —
runs once per request on prompt + tokens, without a cache: in float32, and in the recipe's dtype
where that is lower. Step k (the prefill's last position is step 0, decode step k is step k) passes
when

* the recipe's token is transformers' argmax on that same prefix in float32 or in the recipe's
  dtype, or a tie at that step: a token whose float32 logit is within that step's tolerance of the
  argmax's (kernels that round in another order may pick either; every tie is listed), and
* the recipe's logits are within `tolerance(...)` of transformers' float32 logits at that step.

A sparse-MoE model's top-k routing is discrete: where two experts' selection scores lie within
rounding of each other (a routing tie), the recipe's kernels may pick either, and the other pick
moves that position's output — and, through attention, later steps — by a whole expert's share, far
beyond rounding. So a failing step of an MoE model is judged again against transformers' float32
model with routing ties resolved the other way (`Routing`: the k-th expert exchanged for the best one
left out, at one layer and position, its weights by the gating's own formula), one tie at a time,
earliest failure first: a tie is taken when it makes the first failing step pass, and is kept for the
later steps (the recipe routed that position once; its cache holds the result). A routing tie is a
(layer, position) whose float32 gap between the k-th and the next selection score is within
NOISE_FACTOR times transformers' own move of those scores in the run's dtype (at that position or the
layer's median over the sequence, the larger), never below FLOOR[dtype] of the largest score. Every
tie taken is listed (`routing_ties`); a routing that is wrong (weights not renormalised, another top-k)
moves every position, not a tie's, and fails.

THE TOLERANCE RULE (agent.precision_rule holds it, shared with the native self-check): at each step,
NOISE_FACTOR times the largest |logit| difference between transformers' own model in the recipe's dtype and
in float32 on that prefix — the rounding that dtype causes there — and never below FLOOR[dtype] of the largest float32
|logit| (float32 runs: arithmetic order only). A run tensor parallel N > 1 ways (the YAML's
attn_tp_size, else its ranks) also rounds where its tensor parallelism reduces: each row-parallel
projection is N partial products, each rounded to the run's dtype, summed in it. So transformers' own
model in the run's dtype runs a second time with its row-parallel projections computed so
(`Reference.split_row_parallel`: the `rowwise` entries of the model's own tensor-parallel plan, and
every attention's o_proj, which all split heads), and the step's own move is the larger of the two;
its argmax is one more token the step may pick. A run expert parallel E > 1 ways (its YAML's moe_ep_size,
else world_size // moe_tp_size) sums each token's top-k expert outputs in another order: each EP rank
sums the experts it holds, and the ranks' partial sums are added (a reduce-scatter / all-reduce in the
run's dtype, as upstream's MoE-TP and all-gather paths do; MC2's combine sums in fp32, which this bounds).
So that same second model also computes every sparse-MoE block's experts as E per-rank partial sums
(`Reference.split_expert_parallel`: experts [r*L, (r+1)*L) of rank r, each partial as transformers sums
it, in the run's dtype, then the partials added in it), named in the verdict beside the row-parallel
split. 1-rank and float32 runs are unchanged. A decode step that ran compiled (graph mode: the probe's
layer hooks saw the request's eager prefill and not that step) sums its reductions in the host compiler's order,
not eager's: its tolerance adds one unit in the last place of the run's dtype at the step's largest float32
|logit| (`compiled_step_allowance`; the step says `compiled`). Per decoder layer the same rule locates a failure:
NOISE_FACTOR times transformers' own relative move of that layer's hidden states at that position,
never below LAYER_FLOOR[dtype].

A failure names the first failing step (rank, request, prefill or decode step k) and the first
decoder layer at that step whose hidden states are beyond their tolerance. An empty output (its tokens
decode to whitespace or nothing) fails where transformers' own greedy text on the same prompt (its
float32 argmax at every step) is not empty; where that is empty too, the model itself writes nothing
(untrained weights) and the verdict says so in one line (`empty_output`). `closest` is the step that came nearest its tolerance (error / tolerance).

Runs as `python -m agent.measure.precision --record DIR --checkpoint C` (one JSON object on stdout)
in the interpreter with the recipe's transformers; `check(...)` starts it as one process tree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from agent.precision_rule import FLOOR, NOISE_FACTOR, compiled_step_allowance, tolerance  # noqa: F401 - the rule
from engine import defaults
from engine.safe_load import loads_json
from engine.safe_write import tree_of

LAYER_FLOOR = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 5e-3}
ROUTING_SEARCH_BUDGET = 256      # float32 forwards with a tie resolved the other way, per request
RECORD_ENV = "MIGRATOR_PRECISION_RECORD"
RULE = (f"step k passes when the recipe's token is transformers' argmax on the same prefix (float32 or the "
        f"run's dtype) or within the step's tolerance of it in float32 (a tie), and max |recipe - float32 logits| "
        f"<= the step's tolerance: max({NOISE_FACTOR} x transformers' own max |run dtype - float32| at step k "
        f"(N > 1 ranks: the larger of that and the same with its row-parallel projections as N partial sums, and "
        f"E > 1 expert-parallel ranks: its MoE experts as E per-rank partial sums, in the run dtype), floor x max "
        f"|float32 logit|), a compiled decode step one unit in the last place of the run dtype at max |float32 "
        f"logit| more; a sparse-MoE model's routing ties may be resolved either way (agent.measure.precision)")


def layer_tolerance(own_move: float, dtype: str) -> float:
    return max(NOISE_FACTOR * own_move, LAYER_FLOOR.get(dtype, LAYER_FLOOR["bfloat16"]))


# ---- the record: requests with their steps ------------------------------------------------------
@dataclass
class Step:
    phase: str
    logits: object                    # [V] float32
    layers: list | None               # per layer [tokens, H]: the prompt's rows at prefill, one row at decode
    fed: int | None = None            # the token the recipe fed to the step after this one


@dataclass
class Request:
    rank: int
    index: int
    prompt: list[int]
    steps: list[Step] = field(default_factory=list)
    eos: frozenset = frozenset()

    @property
    def tokens(self) -> list[int]:
        return [int(step.logits.argmax()) for step in self.steps]

    @property
    def finished(self) -> bool:
        return bool(self.steps) and self.tokens[-1] in self.eos


def load_calls(folder: Path) -> list[dict]:
    import torch

    calls = []
    for path in sorted(folder.glob("call_*.pt")):
        try:
            calls.append(torch.load(path, weights_only=True))
        except Exception:  # noqa: BLE001 - a file a killed run left half written: the record ends there
            break
    return calls


def _prefill_rows(call: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the rows of the call's layer tensors that hold them) per request of a prefill."""
    ids = call["input_ids"].tolist()
    shape = call.get("shape") or [len(ids)]
    rows = call["rows"]
    if call.get("seq_ends"):
        ends = call["seq_ends"][:rows]
        starts = [0, *ends[:-1]]
        return [(ids[s:e], list(range(s, e))) for s, e in zip(starts, ends)]
    if len(shape) == 2:
        width = shape[1]
        mask = call.get("attention_mask")
        out = []
        for b in range(shape[0]):
            kept = [t for t in range(width) if mask is None or int(mask[b, t]) == 1]
            out.append(([ids[b * width + t] for t in kept], [b * width + t for t in kept]))
        return out
    return [(ids, list(range(len(ids))))] if rows == 1 else []


def requests_of(calls: list[dict], rank: int, eos: set[int]) -> tuple[list[Request], list[str]]:
    """The last generation of one rank's record (a warm-up before it is the same run again): prefills
    with no decode between them are one generation; decode rows follow its requests in order, one row per
    unfinished request or, where the executor keeps a finished request's row in the batch, one per request
    (`_decode_order`)."""
    generations: list[list[Request]] = []
    decoded = True
    problems: list[str] = []
    for call in calls:
        if call["phase"] == "prefill" and generations and _recomputed(generations[-1], call):
            decoded = True      # a model without a KV cache: each decode step runs the whole sequence again
            for (ids, token_rows), b in zip(_prefill_rows(call), range(call["rows"])):
                request = next(r for r in generations[-1] if _continues(r, ids))
                request.steps[-1].fed = ids[-1]
                layers = None
                if call.get("layers") and all(t.shape[0] > token_rows[-1] for t in call["layers"]):
                    layers = [t[token_rows[-1]:token_rows[-1] + 1] for t in call["layers"]]
                request.steps.append(Step("decode", call["logits"][b], layers))
            continue
        if call["phase"] == "prefill":
            if decoded:
                generations.append([])
                decoded = False
            for b, (prompt, token_rows) in enumerate(_prefill_rows(call)):
                layers = None
                if call.get("layers") and all(t.shape[0] > max(token_rows, default=-1) for t in call["layers"]):
                    layers = [t[token_rows] for t in call["layers"]]
                request = Request(rank, len(generations[-1]), prompt, eos=frozenset(eos))
                request.steps.append(Step("prefill", call["logits"][b], layers))
                generations[-1].append(request)
        elif generations:
            decoded = True
            active = [r for r in generations[-1] if not r.finished]
            ids = call["input_ids"].tolist()
            window = call.get("window") or 1
            rows = _decode_order(generations[-1], active, ids[::window], call["rows"])
            for b, request in enumerate(rows[:call["rows"]]):
                for j in range(window):
                    if request.finished:
                        break
                    row = b * window + j
                    request.steps[-1].fed = ids[row] if row < len(ids) else None
                    layers = None
                    if call.get("layers") and all(t.shape[0] > row for t in call["layers"]):
                        layers = [t[row:row + 1] for t in call["layers"]]
                    request.steps.append(Step("decode", call["logits"][row], layers))
                    # an MTP window: the executor keeps the next draft only where it is this step's token
                    if j + 1 < window and (row + 1 >= len(ids) or request.tokens[-1] != ids[row + 1]):
                        break
            if len(active) > call["rows"]:
                problems.append(f"rank {rank}: a decode call with {call['rows']} rows for {len(active)} unfinished requests")
    return (generations[-1] if generations else []), problems


def _continues(request: Request, ids: list[int]) -> bool:
    """`ids` is the request's sequence so far with one more token fed: its next step, run whole."""
    return not request.finished and bool(request.steps) and len(ids) == len(request.prompt) + len(request.steps) \
        and ids[:-1] == request.prompt + request.tokens[:-1]


def _recomputed(requests: list[Request], call: dict) -> bool:
    """Every row of a prefill call continues an unfinished request of the generation: the next decode step of
    a model that keeps no KV cache (OpenAI GPT), which runs the whole sequence each step."""
    rows = _prefill_rows(call)[:call["rows"]]
    return bool(rows) and all(any(_continues(r, ids) for r in requests) for ids, _ in rows)


def _decode_order(requests: list[Request], active: list[Request], ids: list[int], rows: int) -> list[Request]:
    """Which request each row of a decode call is. An executor that keeps a finished request's row in the
    batch (upstream's static batch feeds it on, padded or not) decodes a row per request; one that drops
    it, a row per unfinished one. Where the call has a row for every request, the order whose unfinished
    requests were each fed their own last token is it (each step feeds the token the step before picked)."""
    if len(active) == len(requests) or rows < len(requests):
        return active

    def fed_own(order):
        return all(b < len(ids) and ids[b] == r.tokens[-1] for b, r in enumerate(order[:rows]) if not r.finished)

    return active if fed_own(active) and not fed_own(requests) else requests


# ---- transformers on prompt + the recipe's tokens ---------------------------------------------
def _decoder_layers(model):
    import torch

    count = model.config.get_text_config().num_hidden_layers
    # the text decoder's layers (an image-text model's vision tower may hold a list of the same length first)
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == count:
        return list(layers)
    for _, child in model.named_modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) == count:
            return list(child)
    return []


class Routing:
    """The sparse-MoE routing of a transformers model, seen and steered at each block's experts call
    (hidden states, top-k index, top-k weights): per MoE layer, every position's selection scores
    (agent.recipe.native.parts.moe.selection under the gating probed from the block) and the gap
    between the k-th and the next; at the (layer, position) pairs of `forced`, the k-th expert
    exchanged for the best one left out, the weights by the gating's formula. None of it for a model
    without sparse-MoE blocks, or with a gating the probe does not recognise."""

    def __init__(self, model, layers):
        from agent.recipe.native.parts.moe import moe_block, gating_of

        self.gating, self.blocks, self.forced, self.seen = None, [], {}, {}
        if not any(moe_block(layer) for layer in layers):
            return
        try:
            self.gating = gating_of(model.config.get_text_config())
        except Exception:  # noqa: BLE001 - NotNative, or the probe failed in code it does not know: the plain rule
            return
        if self.gating["scoring"] not in ("softmax", "sigmoid") or self.gating.get("select_on_logits"):
            self.gating = None      # a gating the tie search does not model (phimoe's sparsemixer): the plain rule
            return
        self.blocks = [(index, found[1]) for index, layer in enumerate(layers) for found in [moe_block(layer)] if found]

    def hooks(self):
        return [block.experts.register_forward_pre_hook(self._hook(index, block), with_kwargs=True)
                for index, block in self.blocks]

    def _hook(self, layer: int, block):
        import torch

        from agent.recipe.native.parts.moe import reference_gating, selection, selection_bias

        g = self.gating
        router = block.get_submodule(g.get("router_path", g["router_name"]))
        # the router's, the block's own (hy_v3, minimax_m2) or under the router's moe_statics (ernie4_5_moe)
        found = selection_bias(block, g["router_name"]) if g["selection_bias"] else None
        bias = found[0].reshape(-1) if found is not None else None
        gating = dict(scoring=g["scoring"], selection_bias=bias, n_group=g["n_group"], topk_group=g["topk_group"],
                      group_select=g["group_select"])

        def hook(module, args, kwargs):
            if len(args) < 3:
                return None
            hidden, index, weights = args[:3]
            with torch.no_grad():
                logits = torch.nn.functional.linear(hidden.to(router.weight.dtype), router.weight,
                                                    getattr(router, "bias", None))
                _, choice = selection(logits, **gating)
                ordered = choice.sort(dim=-1, descending=True, stable=True)
            k = index.shape[-1]
            if choice.shape[-1] <= k:
                return None
            gap = ordered.values[:, k - 1] - ordered.values[:, k]
            agrees = torch.equal(index.sort(-1).values.long(), ordered.indices[:, :k].sort(-1).values)
            self.seen[layer] = {"choice": choice.detach().float().cpu(), "gap": gap.detach().float().cpu(),
                                "agrees": agrees}
            rows = sorted(p for p in self.forced.get(layer, ()) if p < index.shape[0])
            if not rows or not agrees:
                return None
            chosen = ordered.indices[:, :k].clone()
            chosen[rows, k - 1] = ordered.indices[rows, k]
            forced_weights, _ = reference_gating(logits, k=k, scoring=g["scoring"], renormalize=g["renormalize"],
                                                 selection_bias=bias, n_group=g["n_group"], topk_group=g["topk_group"],
                                                 group_select=g["group_select"],
                                                 routed_scaling_factor=g["routed_scaling_factor"], index=chosen)
            index, weights = index.clone(), weights.clone()
            index[rows] = chosen[rows].to(index.dtype)
            weights[rows] = forced_weights[rows].to(weights.dtype)
            return (hidden, index, weights, *args[3:]), kwargs

        return hook


class Reference:
    """transformers' own model of the checkpoint in one dtype: logits and per-layer hidden states of
    a whole sequence in one forward (no cache: the oracle of every step at once), and, for a
    sparse-MoE model, its routing (`Routing`), which `forced` can steer."""

    def __init__(self, checkpoint: Path, dtype: str, overrides: dict, trust_remote_code: bool):
        import torch
        from agent.recipe.text_decoder import transformers_auto_class

        self.model = transformers_auto_class(checkpoint).from_pretrained(
            checkpoint, dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=trust_remote_code,
            **overrides).eval()
        self.name = type(self.model).__name__
        self.layers = _decoder_layers(self.model)
        self.routing = Routing(self.model, self.layers)

    def run(self, ids: list[int], forced: dict | None = None):
        """(logits [T, V], per-layer hidden states, routing {layer: {"choice", "gap", "agrees"}} or None)."""
        import torch

        captured: list = []
        # a layer returns its hidden states, or a tuple / list (OpenAI GPT's blocks) with them first
        hooks = [layer.register_forward_hook(lambda m, a, out: captured.append(
            (out[0] if isinstance(out, (tuple, list)) else out).detach().float()[0])) for layer in self.layers]
        self.routing.forced, self.routing.seen = dict(forced or {}), {}
        hooks += self.routing.hooks()
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids], dtype=torch.long)).logits[0].float()
        finally:
            for hook in hooks:
                hook.remove()
            self.routing.forced = {}
        return logits, captured, (dict(self.routing.seen) if self.routing.blocks else None)

    def split_row_parallel(self, parts: int) -> list[str]:
        """Compute every row-parallel projection of the decoder layers as `parts` partial products over its
        input features, each in the model's dtype, summed in it: the rounding an N-way tensor-parallel
        reduction adds (see the module docs). Returns the projections split (none: the model has none
        this recognises; a fused MoE's stacked experts are parameters, not projections, and are left)."""
        import fnmatch

        import torch

        plan = dict(getattr(self.model.config.get_text_config(), "base_model_tp_plan", None) or {})
        rowwise = [pattern for pattern, style in plan.items() if "rowwise" in str(style) and "embedding" not in str(style)]
        in_layers = {id(m) for layer in self.layers for m in layer.modules()}
        split = []
        for name, module in self.model.named_modules():
            if type(module) is not torch.nn.Linear or module.in_features < parts or id(module) not in in_layers:
                continue
            if not (name.endswith("self_attn.o_proj") or any(fnmatch.fnmatch(name, f"*{p}") for p in rowwise)):
                continue

            def forward(x, weight=module.weight, bias=module.bias):
                chunks = torch.tensor_split(torch.arange(weight.shape[1]), parts)
                out = sum(torch.nn.functional.linear(x[..., c], weight[:, c]) for c in chunks)
                return out if bias is None else out + bias

            module.forward = forward
            split.append(name)
        return split

    def split_expert_parallel(self, parts: int) -> list[str]:
        """Compute every sparse-MoE block's experts as `parts` per-rank partial sums: rank r holds experts
        [r*L, (r+1)*L) (L = experts / parts, upstream's EP layout); each partial is transformers' own experts
        call with the other ranks' routing weights zeroed (so it sums what rank r holds, in transformers' order
        and dtype), and the partials are added in the model's dtype, rank by rank (see the module docs).
        Returns the blocks split (none: no sparse-MoE block, or experts not divisible by `parts`)."""
        import torch

        from agent.recipe.native.parts.moe import moe_block

        split = []
        for index, layer in enumerate(self.layers):
            found = moe_block(layer)
            if found is None:
                continue
            name, block = found
            experts = block.experts
            count = getattr(experts, "num_experts", None) or experts.gate_up_proj.shape[0]
            if parts < 2 or count % parts:
                continue
            local, whole = count // parts, experts.forward

            def forward(hidden, top_k_index, top_k_weights, *rest, whole=whole, local=local, **kwargs):
                owner = torch.div(top_k_index, local, rounding_mode="floor")
                total = None
                for rank in range(parts):
                    weights = torch.where(owner == rank, top_k_weights, torch.zeros_like(top_k_weights))
                    partial = whole(hidden, top_k_index, weights, *rest, **kwargs)
                    total = partial if total is None else total + partial
                return total

            experts.forward = forward
            split.append(f"{index}.{name}")
        return split

    def release(self) -> None:
        """Free the weights: the float32 and the run-dtype models are never held at once."""
        import gc

        self.model = self.layers = self.routing = None
        gc.collect()


class Replayed:
    """What one Reference computed for a set of sequences, kept after its weights were released (the
    float32 model alone is twice a bf16 checkpoint; both at once would be three times)."""

    def __init__(self, reference: Reference, sequences) -> None:
        self.name = reference.name
        self.outputs = {tuple(ids): reference.run(list(ids)) for ids in sequences}

    def run(self, ids: list[int]):
        return self.outputs[tuple(ids)]


def routing_ties(routing: dict | None, exact_routing: dict | None, rounded_routing: dict | None, dtype: str) -> dict:
    """{(layer, position): (float32 gap, its tie tolerance)} of the routing ties of `routing` (float32,
    ties resolved so far), the tolerance from transformers' own unsteered move (`exact_routing` against
    `rounded_routing`, see the module docs)."""
    import torch

    ties = {}
    for layer, seen in (routing or {}).items():
        base = (exact_routing or {}).get(layer)
        if not seen["agrees"] or base is None or base["choice"].shape != seen["choice"].shape:
            continue
        choice, gap = base["choice"], seen["gap"]
        finite = torch.isfinite(choice)
        other = (rounded_routing or {}).get(layer)
        if other is not None and other["choice"].shape == choice.shape:
            both = finite & torch.isfinite(other["choice"])
            move = torch.where(both, (other["choice"] - choice).abs(), torch.zeros_like(choice)).amax(-1)
        else:
            move = torch.zeros(choice.shape[0])
        scale = torch.where(finite, choice.abs(), torch.zeros_like(choice)).amax(-1)
        allowed = torch.maximum(NOISE_FACTOR * torch.maximum(move, move.median()),
                                FLOOR.get(dtype, FLOOR["bfloat16"]) * scale)
        for position in (gap <= allowed).nonzero().flatten().tolist():
            ties[(layer, position)] = (float(gap[position]), float(allowed[position]))
    return ties


def _relative(mine, ref) -> float | None:
    if mine is None or ref is None or tuple(mine.shape) != tuple(ref.shape):
        return None
    return (mine - ref).norm().item() / max(ref.norm().item(), 1e-12)


def judge_steps(request: Request, fp_logits, fp_layers, lo_logits, lo_layers, dtype: str,
                reduced=None) -> tuple[list, dict | None]:
    """Every step of one request against the float32 logits (and the run dtype's for the tolerance;
    `reduced`: (logits, layers) of the run dtype's model with its row-parallel reductions, N > 1 ranks)."""
    tokens, prompt = request.tokens, request.prompt
    vocab = fp_logits.shape[-1]
    steps, first = [], None
    for k, step in enumerate(request.steps):
        position = len(prompt) - 1 + k
        mine = step.logits[:vocab].float()
        fp = fp_logits[position]
        lo = lo_logits[position] if lo_logits is not None else fp
        own = (lo - fp).abs().max().item()
        argmax = {int(fp.argmax()), int(lo.argmax())}
        if reduced is not None:
            own = max(own, (reduced[0][position] - fp).abs().max().item())
            argmax.add(int(reduced[0][position].argmax()))
        error = (mine - fp).abs().max().item()
        scale = fp.abs().max().item()
        allowed = tolerance(own, scale, dtype)
        compiled = compiled_step(request, step)
        if compiled:
            allowed += compiled_step_allowance(scale, dtype)
        token = tokens[k]
        gap = (fp.max() - fp[token]).item()
        record = {"step": k, "phase": step.phase, "token": token, "reference_argmax_float32": int(fp.argmax()),
                  f"reference_argmax_{dtype}": int(lo.argmax()), "max_abs_logits_diff": round(error, 6),
                  "reference_own_move": round(own, 6), "tolerance": round(allowed, 6),
                  "ratio": round(error / allowed, 4) if allowed > 0 else (0.0 if error == 0 else math.inf),
                  "token_ok": token in argmax or gap <= allowed, "logits_ok": error <= allowed}
        if compiled:
            record["compiled"] = True
        if token not in argmax:
            record["tie"] = {"float32_gap": round(gap, 6)}
        fed_ok = step.fed is None or step.fed == token
        if not fed_ok:
            record["fed"] = step.fed
        record["ok"] = record["token_ok"] and record["logits_ok"] and fed_ok
        if not record["ok"] and first is None:
            first = record
            record["layer"] = locate(step, fp_layers, lo_layers, prompt, position, dtype,
                                     reduced[1] if reduced is not None else None)
        steps.append(record)
    return steps, first


def compiled_step(request: Request, step: Step) -> bool:
    """A decode step that ran compiled (graph mode): no decoder-layer hook saw it, where hooks saw the request's
    eager prefill (the probe's hooks do nothing inside a compiled region)."""
    return step.phase == "decode" and not step.layers and bool(request.steps and request.steps[0].layers)


def judge_request(request: Request, exact: Reference | Replayed, rounded: Reference | Replayed | None,
                  dtype: str, decode_text, steered=None, reduced: Reference | Replayed | None = None) -> dict:
    """Every step of one request against the references (see the module docs). `steered(sequence,
    forced)`: transformers' float32 model with routing ties resolved the other way (a sparse-MoE
    model's failing steps are judged again with it)."""
    tokens = request.tokens
    prompt = request.prompt
    sequence = prompt + tokens[:-1]
    fp_logits, fp_layers, fp_routing = exact.run(sequence)
    lo_logits, lo_layers, lo_routing = rounded.run(sequence) if rounded is not None else (None, None, None)
    lo_reduced = reduced.run(sequence)[:2] if reduced is not None else None
    steps, first = judge_steps(request, fp_logits, fp_layers, lo_logits, lo_layers, dtype, lo_reduced)
    unsteered = fp_routing
    forced: dict[int, set] = {}
    taken, tried, budget_spent = [], set(), False
    while first is not None and fp_routing and steered is not None:
        if len(tried) >= ROUTING_SEARCH_BUDGET:
            budget_spent = True
            break
        position = len(prompt) - 1 + first["step"]
        ties = routing_ties(fp_routing, unsteered, lo_routing, dtype)
        candidates = sorted(((gap / max(allowed, 1e-30), layer, p) for (layer, p), (gap, allowed) in ties.items()
                             if p <= position and p not in forced.get(layer, ()) and (layer, p) not in tried),
                            key=lambda c: (c[0], c[2], c[1]))
        found = None
        for _, layer, p in candidates[:max(0, ROUTING_SEARCH_BUDGET - len(tried))]:
            tried.add((layer, p))
            trial = {**{l: set(ps) for l, ps in forced.items()}, layer: forced.get(layer, set()) | {p}}
            out = steered(sequence, trial)
            trial_steps, trial_first = judge_steps(request, out[0], out[1], lo_logits, lo_layers, dtype, lo_reduced)
            if trial_first is None or trial_first["step"] > first["step"]:
                found = (layer, p, trial, out, trial_steps, trial_first)
                break
        if found is None:
            break
        layer, p, forced, (fp_logits, fp_layers, fp_routing), steps, first = found
        gap, allowed = ties[(layer, p)]
        taken.append({"layer": layer, "position": p, "float32_gap": round(gap, 6), "tolerance": round(allowed, 6)})
    text = decode_text(tokens)
    # transformers' own greedy text on the same prompt: its float32 argmax at every step (the recipe's tokens
    # where they are those, which is every step but a tie's)
    reference_text = decode_text([step["reference_argmax_float32"] for step in steps])
    empty, writes_nothing = not text.strip(), not reference_text.strip()
    result = {"rank": request.rank, "request": request.index, "prompt_tokens": len(prompt), "tokens": len(tokens),
              "text": text, "empty": empty, "reference_text": reference_text, "steps": steps, "first_failure": first,
              # an empty output fails only where transformers' own writes something: else the model writes nothing
              "ok": first is None and (not empty or writes_nothing)}
    if taken:
        result["routing_ties"] = taken
    if budget_spent and first is not None:
        result["routing_search"] = f"{ROUTING_SEARCH_BUDGET} routing ties tried, none made {step_name(first)} pass"
    return result


def locate(step: Step, fp_layers, lo_layers, prompt, position: int, dtype: str, reduced_layers=None) -> dict:
    """The first decoder layer at this step whose hidden states leave transformers' beyond rounding."""
    if not step.layers:
        return {"layer": None, "why": "no per-layer record at this step (a compiled step runs no hooks; a "
                                      "context-parallel prefill's ranks each hold only their own segments)"}
    if step.phase == "prefill":
        rows = slice(0, len(prompt))
    else:
        rows = slice(position, position + 1)
    errors, tolerances = [], []
    for index, mine in enumerate(step.layers):
        if index >= len(fp_layers):
            break
        ref = fp_layers[index][rows]
        own = _relative(lo_layers[index][rows], ref) if lo_layers else 0.0
        if reduced_layers and index < len(reduced_layers):
            own = max(own or 0.0, _relative(reduced_layers[index][rows], ref) or 0.0)
        errors.append(_relative(mine.float(), ref))
        tolerances.append(layer_tolerance(own or 0.0, dtype))
    first = next((i for i, (e, t) in enumerate(zip(errors, tolerances)) if e is not None and e > t), None)
    return {"layer": first, "layer_relative_errors": [None if e is None else round(e, 6) for e in errors],
            "layer_tolerances": [round(t, 6) for t in tolerances]}


def step_name(record: dict) -> str:
    return "the prefill" if record["phase"] == "prefill" else f"decode step {record['step']}"


def logged_texts(log_dir: Path | None) -> dict[int, dict[int, str]]:
    """rank -> request -> the text its log says it generated (`Request i: outputs: TEXT`)."""
    import re

    found: dict[int, dict[int, str]] = {}
    if log_dir is None or not Path(log_dir).is_dir():
        return found
    line = re.compile(r"Request (\d+): outputs: (.*)$")
    for log in Path(log_dir).glob("log_*.log"):
        rank = int(re.sub(r"\D", "", log.stem) or 0)
        texts: dict[int, str] = {}
        with open(log, encoding="utf-8", errors="replace", newline="") as f:
            for row in f.read().split("\n"):
                m = line.search(row)
                if m:
                    texts[int(m.group(1))] = m.group(2)   # the last generation's (the formal run) wins
        found[rank] = texts
    return found


def against_logs(results: list[dict], logs: dict[int, dict[int, str]]) -> tuple[list[str], list[str]]:
    """(missing, differing): requests whose recorded tokens are only the start of what the log says was
    generated (steps the probe did not see: a compiled step), and those whose text is another. A record
    may hold more than the log (a step computed and not output)."""
    def plain(text: str) -> str:
        # a byte-level BPE text may end inside a character: the executor and the tokenizer mark it apart
        return text.replace("\ufffd", "").strip()

    missing, differing = [], []
    for r in results:
        logged = logs.get(r["rank"], {}).get(r["request"])
        # the executor may compute a step more than it outputs (upstream's scheduler: max_new_tokens + 1 calls)
        if logged is None or plain(r["text"]).startswith(plain(logged)):
            continue
        where = f"rank {r['rank']} request {r['request']}"
        (missing if plain(logged).startswith(plain(r["text"])) else differing).append(where)
    return missing, differing


def quantized_weights(checkpoint: Path) -> str | None:
    """What the reference ran for a quantized checkpoint (its quantization as agent.migrate.quantization reads it):
    the same quantized weights as the recipe, through transformers' own quantizer; None for a float checkpoint."""
    from agent.errors import InputError
    from agent.migrate.quantization import scheme_of
    from engine.safe_load import load_json

    try:
        config = load_json(Path(checkpoint) / "config.json")
        scheme = scheme_of(config, Path(checkpoint)) if isinstance(config, dict) else None
    except (OSError, ValueError, InputError):
        return None
    if scheme is None:
        return None
    return f"{scheme.label}, the checkpoint's quantized weights as transformers' own quantizer loads them"


def verify_record(record_dir: Path, checkpoint: Path, dtype: str | None = None, overrides: dict | None = None,
                  trust_remote_code: bool = False, log_dir: Path | None = None,
                  tensor_parallel: int | None = None, expert_parallel: int | None = None) -> dict:
    """The check itself, in this process (see the module docs). `tensor_parallel`: the run's attention
    tensor-parallel size where its YAML says (default: its ranks); `expert_parallel`: its moe_ep_size (default 1)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    ranks = sorted((p for p in record_dir.glob("rank_*") if p.is_dir()), key=lambda p: int(p.name[5:] or 0))
    calls = {int(p.name[5:]): load_calls(p) for p in ranks}
    calls = {rank: found for rank, found in calls.items() if found}
    base = {"ok": False, "checked": False, "method": "precision, per step, teacher-forced", "rule": RULE}
    if not calls:
        return {**base, "reason": saw_no_model_call(record_dir)}
    dtype = dtype or next((c.get("dtype") for found in calls.values() for c in found if c.get("dtype")), "float32")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    model = Reference(checkpoint, "float32", overrides or {}, trust_remote_code)
    eos: set[int] = set()
    for source in (model.model.config, model.model.generation_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        eos |= set(value) if isinstance(value, (list, tuple)) else ({value} if value is not None else set())

    def decode_text(tokens):
        return tokenizer.decode(torch.tensor(tokens, dtype=torch.long), skip_special_tokens=True)

    problems, judged = [], []
    for rank, found in calls.items():
        requests, trouble = requests_of(found, rank, eos)
        problems += trouble
        judged += [(rank, request) for request in requests if request.steps]
    # every sequence through the float32 model, then its weights released before the run dtype's load
    sequences = {tuple(request.prompt + request.tokens[:-1]) for _, request in judged}
    nll = prompt_nll(model, tokenizer)
    exact = Replayed(model, sequences)
    model.release()
    rounded = reduced = None
    split, parts, expert_split, experts = [], tensor_parallel or len(calls), [], expert_parallel or 1
    if dtype != "float32":
        model = Reference(checkpoint, dtype, overrides or {}, trust_remote_code)
        rounded = Replayed(model, sequences)
        # N-way tensor / E-way expert parallel: the rounding of their reductions too
        split = model.split_row_parallel(parts) if parts > 1 else []
        expert_split = model.split_expert_parallel(experts) if experts > 1 else []
        reduced = Replayed(model, sequences) if split or expert_split else None
        model.release()

    live: list = []

    def steered(sequence, forced):
        """float32 transformers with routing ties resolved the other way: loaded again only when a
        sparse-MoE model's step fails (the run dtype's model is released by then)."""
        if not live:
            live.append(Reference(checkpoint, "float32", overrides or {}, trust_remote_code))
        return live[0].run(list(sequence), forced)

    results, cache = [], {}
    for rank, request in judged:
        key = (tuple(request.prompt), tuple(request.tokens))
        if key not in cache:
            cache[key] = judge_request(request, exact, rounded, dtype, decode_text, steered, reduced)
        results.append({**cache[key], "rank": rank, "request": request.index})
    if live:
        live[0].release()
    if not results:
        return {**base, "reason": f"the precision record in {record_dir} holds no request with a prefill"}
    every = [(r, s) for r in results for s in r["steps"]]
    closest_r, closest_s = max(every, key=lambda rs: rs[1]["ratio"])
    failed = next((r for r in results if not r["ok"]), None)
    summary = {**base, "checked": True, "ok": failed is None and not problems,
               "reference": f"transformers {transformers.__version__} {exact.name}",
               "dtype": dtype, "reference_dtypes": ["float32", *([dtype] if rounded else []),
                                                    *([reduced_name(dtype, split, parts, expert_split, experts)]
                                                      if reduced else [])],
               "ranks": len(calls), "requests": len(results), "steps_checked": len(every),
               "decode_steps_checked": sum(1 for _, s in every if s["phase"] == "decode"),
               "closest": {"rank": closest_r["rank"], "request": closest_r["request"], "step": closest_s["step"],
                           "phase": closest_s["phase"], "ratio": closest_s["ratio"],
                           "max_abs_logits_diff": closest_s["max_abs_logits_diff"],
                           "tolerance": closest_s["tolerance"]},
               "max_abs_logits_diff": max(s["max_abs_logits_diff"] for _, s in every),
               "greedy_tokens": max(r["tokens"] for r in results),
               "greedy_tokens_equal": all(s["token"] == s["reference_argmax_float32"] for _, s in every),
               "ties": [{"rank": r["rank"], "request": r["request"], "step": s["step"], **s["tie"]}
                        for r, s in every if "tie" in s][:16],
               "routing_ties": [{"rank": r["rank"], "request": r["request"], **tie}
                                for r in results for tie in r.get("routing_ties", [])][:16],
               "routing_ties_taken": sum(len(r.get("routing_ties", [])) for r in results),
               "tokens_off_float32_argmax": sum(1 for _, s in every if s["token"] != s["reference_argmax_float32"]),
               "per_request": [{k: v for k, v in r.items() if k != "steps"} for r in results]}
    if split:
        summary["row_parallel_split"] = {"parts": parts, "projections": split[:8], "count": len(split)}
    if expert_split:
        summary["expert_parallel_split"] = {"parts": experts, "blocks": expert_split[:8], "count": len(expert_split)}
    summary.update(nll)
    quantized = quantized_weights(checkpoint)
    if quantized:
        summary["reference_weights"] = quantized
    missing, differing = against_logs(results, logged_texts(log_dir))
    if differing:
        problems.append(f"the text logged for {', '.join(differing[:3])} is not the text of the tokens its steps "
                        "computed")
    silent = [r for r in results if r["empty"] and r["ok"]]
    if silent:
        summary["empty_output"] = writes_nothing_line(silent)
    if problems:
        summary["ok"] = False
        summary["reason"] = "; ".join(problems[:3])
    elif failed is None and missing:
        # no verdict from a record that lacks steps: never "parity ok" on what was not seen
        summary.update(ok=None, reason=f"the record lacks decode steps of {', '.join(missing[:3])} (a compiled decode "
                                       "step runs no hooks): not checked")
    elif failed is not None:
        summary["reason"] = failure_reason(failed, dtype)
        summary["first_failure"] = {"rank": failed["rank"], "request": failed["request"],
                                    **(failed["first_failure"] or {"empty": True})}
        layer = (failed["first_failure"] or {}).get("layer") or {}
        summary["first_divergent_layer"] = layer.get("layer")
        summary["first_failing_step"] = (step_name(failed["first_failure"]) if failed["first_failure"]
                                         else "the whole output (empty)")
    return summary


def reduced_name(dtype: str, split: list, parts: int, expert_split: list, experts: int) -> str:
    """The verdict's name of the second run-dtype reference: what it computes as the run's ranks reduce."""
    what = [f"{len(split)} row-parallel projections as {parts} partial sums"] if split else []
    if expert_split:
        what.append(f"{len(expert_split)} MoE blocks' experts as {experts} expert-parallel partial sums")
    return ", ".join([dtype, *what])


def prompt_nll(exact: Reference, tokenizer) -> dict:
    """How well the checkpoint's own model predicts the default prompt (random weights write noise)."""
    import torch

    from engine.data import DEFAULT_PROMPT
    from agent.measure.parity import prompt_nll as nll

    ids = tokenizer([DEFAULT_PROMPT], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = exact.model(ids).logits.float()
    return nll(logits, ids)


def writes_nothing_line(silent: list[dict]) -> str:
    """The one line a report gives a run whose empty output is the model's own (see judge_request)."""
    where = ", ".join(f"rank {r['rank']} request {r['request']}" for r in silent[:3])
    return (f"the model itself writes nothing here ({where}): its greedy tokens decode to empty text, and so do "
            "transformers' own on the same prompt (untrained weights write special tokens only)")


def failure_reason(failed: dict, dtype: str) -> str:
    where = f"(rank {failed['rank']}, request {failed['request']})"
    first = failed["first_failure"]
    if first is None:
        return (f"the recipe's output is empty {where}, though transformers' own greedy text on the same prompt is "
                f"{failed.get('reference_text', '')[:80]!r}")
    what = []
    if not first["token_ok"]:
        what.append(f"its token {first['token']} is not transformers' argmax on the same prefix "
                    f"({first['reference_argmax_float32']} in float32, {first[f'reference_argmax_{dtype}']} in {dtype})")
    if not first["logits_ok"]:
        compiled = ", and one rounding of a compiled step" if first.get("compiled") else ""
        what.append(f"its logits differ by {first['max_abs_logits_diff']} (tolerance {first['tolerance']}: "
                    f"{NOISE_FACTOR} x transformers' own {dtype} move {first['reference_own_move']} there{compiled})")
    if "fed" in first:
        what.append(f"it fed token {first['fed']} to the next step, not its own greedy token {first['token']}")
    layer = first.get("layer") or {}
    if layer.get("layer") is not None:
        index = layer["layer"]
        located = (f", first at decoder layer {index} (relative error {layer['layer_relative_errors'][index]} of "
                   f"its hidden states; tolerance {layer['layer_tolerances'][index]})")
    elif layer.get("why"):
        located = f" ({layer['why']})"
    elif layer.get("layer_relative_errors"):
        located = ", after every decoder layer (the final norm or lm_head)"
    else:
        located = ""
    return f"the recipe diverges from transformers at {step_name(first)} {where}{located}: {' and '.join(what)}"


# ---- from the migrator: the probe in every run, the check as one process tree ------------------
def probe_dir() -> Path:
    return Path(__file__).resolve().parent / "_precision_probe"


def record_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "precision"


def recorded(record_dir: Path) -> bool:
    """The probe wrote at least one call of the model in `record_dir`."""
    return Path(record_dir).is_dir() and any(Path(record_dir).glob("rank_*/call_*.pt"))


def saw_no_model_call(record_dir: Path) -> str:
    """The verdict's reason for a run whose record the probe did not write (the one wording of it)."""
    what = "is empty" if Path(record_dir).is_dir() else "was not written"
    return (f"the probe saw no model call: the run's precision record {record_dir} {what} (the recipe's processes "
            "never called a model the probe knows as a causal LM, or never reached their model)")


def probe_env(env: dict, run_dir: Path) -> dict:
    """`env` with the probe installed (its sitecustomize first on PYTHONPATH; it runs the one it
    shadows, the npu stand-in's among them) and recording into the run folder."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(probe_dir()), env.get("PYTHONPATH")]))
    env[RECORD_ENV] = str(record_dir(run_dir))
    return env


def check(record_dir: Path, checkpoint: Path, *, python: str | None = None, dtype: str | None = None,
          overrides: dict | None = None, trust_remote_code: bool = False, random_weights: bool = False,
          timeout: int = defaults.TIMEOUT_S, pids_file: Path | None = None, pids_root: Path | None = None,
          cwd: Path | None = None, log_dir: Path | None = None, tensor_parallel: int | None = None,
          expert_parallel: int | None = None) -> dict:
    """`verify_record` in `python` (default: this interpreter), as one process tree the migrator owns
    (stopped with it on SIGINT / SIGTERM or the timeout). `pids_file`: its pids, kept in the recipe
    `pids_root`."""
    from agent.child_failure import child_failure
    from agent.processes import owned_temp, run_tree, stop_leftovers

    if not recorded(record_dir):       # nothing to hold to transformers: a verdict, no child started
        return {"ok": False, "checked": False, "method": "precision, per step, teacher-forced", "rule": RULE,
                "reason": saw_no_model_call(record_dir)}
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NPU_STANDIN") and k not in (RECORD_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [python or sys.executable, "-m", "agent.measure.precision", "--record", str(record_dir),
           "--checkpoint", str(checkpoint)]
    if dtype:
        cmd += ["--dtype", dtype]
    if overrides:
        cmd += ["--overrides", json.dumps(overrides)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if log_dir is not None:
        cmd += ["--logs", str(log_dir)]
    if tensor_parallel:
        cmd += ["--tensor-parallel", str(tensor_parallel)]
    if expert_parallel and expert_parallel > 1:
        cmd += ["--expert-parallel", str(expert_parallel)]
    if pids_file is not None:
        stop_leftovers(pids_file, pids_root)
    # the verdict goes to a file of its own: the model's code (remote code) may print anything
    with owned_temp("precision") as tmp, tempfile.TemporaryFile("w+") as err:
        answer = Path(tmp) / "verdict.json"
        tree = run_tree([*cmd, "--out", str(answer)], cwd=cwd or record_dir, env=env, stdout=subprocess.DEVNULL,
                        stderr=err, timeout=timeout, pids_file=pids_file, pids_root=pids_root)
        err.seek(0)
        stderr = err.read()
        text = answer.read_text() if answer.is_file() else ""
    if tree.returncode != 0 or not text:
        why = child_failure(stderr, tree.returncode, timed_out=tree.timed_out, timeout_s=timeout,
                            no_answer=f"its verdict ({answer}) is not there: its temporary folder was removed while it "
                                      "ran")
        return {"ok": False, "checked": False, "method": "precision, per step, teacher-forced",
                "reason": f"the precision check could not run: {why}"}
    result = loads_json(text)
    if random_weights:
        result["untrained_weights"] = True
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.measure.precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, required=True, help="the run's precision record folder")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--dtype", help="the run's dtype (default: the record's)")
    parser.add_argument("--overrides", default="{}", help="config overrides (JSON) the recipe applies")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--logs", type=Path, help="the run's rank logs: their texts must be the record's")
    parser.add_argument("--out", type=Path, help="write the verdict there (default: stdout)")
    parser.add_argument("--tensor-parallel", type=int, help="the run's attention tensor-parallel size (default: "
                                                             "its ranks)")
    parser.add_argument("--expert-parallel", type=int, help="the run's moe_ep_size (default 1)")
    args = parser.parse_args(argv)
    from engine.environment import import_torch

    import_torch()
    try:
        result = verify_record(args.record, args.checkpoint, args.dtype, loads_json(args.overrides),
                               args.trust_remote_code, args.logs, args.tensor_parallel, args.expert_parallel)
    except Exception as exc:  # noqa: BLE001 - only transformers' own failures are answered here
        from agent.measure.parity import transformers_failed

        result = transformers_failed(exc, "checkpoint")
        if result is None:
            raise
        result["method"] = "precision, per step, teacher-forced"
    text = json.dumps(result, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
    if args.out:
        tree_of(args.out).write_text(args.out, text)

    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
