"""The native file against transformers before it is written: `python -m agent.recipe.native.selfcheck JOB.json`
under the npu stand-in (torch_npu's ops are its reference kernels), a cann-recipes-infer checkout on
sys.path (module.linear, executor.*).

For each job: transformers' model on the shrunk config (agent.recipe.native.parts.probe.shrunk_config: tiny
widths and vocabulary, the kernels' head / rope / latent dims as the checkpoint has them; `changes`: one of the
family's other settings the file must also serve), random weights at the config's initializer_range (every
parameter, norms and biases too), and the generated file's ForCausalLM loading them as a checkpoint stores
them (transformers' own conversion reverted: the names save_pretrained writes; a tied checkpoint without
lm_head.weight), in the job's dtype: float32 (within TOLERANCE of transformers' float32 logits or of its float64
ones, or FLOAT32_SLACK x transformers' own float32 error where that is larger: float32_judgement) or the run dtype
bfloat16, held by the precision verdict's rule (agent.precision_rule.tolerance: 2 x transformers' own
|bfloat16 - float32| move at that step, floor 1e-3 x max |logit|) with RUN_DTYPE_SLACK; there an MoE routing tie
(the file's experts for a token a top-k of transformers' float32 router logits within bfloat16's rounding of them:
RoutingTies) is taken as given, both references steered to the file's choice at that token. The model runs through
the executor's contract as its ModelWorker drives it: a packed prefill of prompts of unequal length, then decode
steps, on a paged cache of small blocks whose sliding-window tables point the blocks before the window at the null
block, and every table's padding too, as upstream's SlidingWindowManager and prepare_block_tables do. The
null block holds NaN before every step (the positions before a window are written there): a step that reads
it, even masked, fails (the reference kernels sum 0 x NaN), so a decode reads what it attends to — its
window's blocks, its own length — or it fails. Every step's logits are compared with transformers' on the
same tokens, computed as transformers decodes (one cache per sequence, token by token). Prints one JSON line:
per job {"ok", "max_rel" (the largest logit difference relative to the largest logit), "ratio" (the
largest to its tolerance), "by_float64" (the float32 steps within it of transformers' float64 logits only),
"reason", and where ties were taken "routing_ties" (their count) and "note" (the line that says so)};
"checkable": false where transformers' own model raised building or running the job's config
(ReferenceFailed: the reason is its error; the generated file was not held to anything).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import math
import os
import sys
import traceback
from types import SimpleNamespace

from agent.precision_rule import MANTISSA_BITS
from engine.safe_load import load_json

BLOCK_SIZE = 4
PROMPT_LENGTHS = (13, 6, 3)     # the shrunk window is 5: one prompt past it, one reaching it, one short of it
DECODE_STEPS = 5
TOLERANCE = 1e-4            # relative to the largest logit: float32 against float32
RUN_DTYPE = "bfloat16"
# the run dtype's check allows this many times the precision verdict's tolerance: two bfloat16 computations of
# one model (transformers' and the kernels') differ from float32 by errors of one size, whose ratio at a step
# is noise around 1 (and an MoE routing tie moves a step further); what it catches is a systematic loss (a
# width computed in bfloat16 that transformers keeps in float32: tens of times the tolerance). The trial's
# verdict then judges the real checkpoint by the rule itself.
RUN_DTYPE_SLACK = 2.0
# the run dtype's steps: the packed prefill and the first decode (both paths, on a cache the prefill wrote); later
# steps carry those steps' rounding through the cache, and in an MoE model a routing tie (a whole expert's share),
# which the verdict's tie search judges on the real run
RUN_DTYPE_DECODE_STEPS = 1
ROUTER_GAIN = 8.0
# the run dtype's unit roundoff (round to nearest): |round(x) - x| <= RUN_DTYPE_ROUNDOFF x |x|. A run-dtype job's MoE
# routing tie is a token whose float32 router logits, each moved by no more than rounding the router's weight, its
# input and its logit to the run dtype can move it (rounding_reach), rank the file's experts top: which of such
# experts a bfloat16 router picks is its rounding's chance, and the other pick moves the token by a whole expert's
# share, so the references take the file's choice there (RoutingTies) and the verdict says so
RUN_DTYPE_ROUNDOFF = 2.0 ** -(MANTISSA_BITS[RUN_DTYPE] + 1)
# a float32 step over TOLERANCE passes within this many times transformers' own float32 error at that step (its
# float32 logits against its float64 ones) of either: two float32 computations of one model each err by about
# that much from the float64 logits
FLOAT32_SLACK = 2.0
# transformers' cached decode against its own whole-sequence run, relative to the largest logit: past the check's own
# float32 tolerance its cache path cannot judge a file at that tolerance (jamba's drifts by 1e-4 to 1e-3 on a prompt
# no longer than its conv's history), so the whole sequence does (a bfloat16 reference's two paths round apart by up
# to a few 1e-2)
CACHE_TOLERANCE = TOLERANCE
CACHE_TOLERANCE_LOW = 1e-1
# rope types whose frequencies follow the sequence's length: transformers' cached decode keeps each key as its own
# step rotated it and its whole-sequence run rotates every key at the new length, so the two differ by design (the
# paged-cache file computes the cached one)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
TRACE = bool(os.environ.get("NATIVE_SELFCHECK_TRACE"))
MAMBA = "Mamba"     # upstream's cache kind of a fixed-size per-request state (a linear attention's)


class ReferenceFailed(Exception):
    """transformers' own model raised while it was built or run on the job's config: the job checks nothing (a
    setting transformers cannot run is no checkpoint anyone publishes), and the fault is not the generated file's."""


def error_line(exc: BaseException) -> str:
    """`Type: message (file:line)` of an exception, its innermost frame, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200] + where


def by_reference(call, *args):
    """`call(*args)` on transformers' side (building its model, its logits): whatever it raises is ReferenceFailed."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - any error of transformers' own model: this job cannot be checked
        raise ReferenceFailed(error_line(exc)) from exc


def _infer_config(block_size: int, exe_mode: str = "eager"):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=1, attn_tp_size=1, lmhead_tp_size=1, moe_tp_size=1, moe_ep_size=1,
                                        embed_tp_size=1),
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


class StateTables:
    """The block table of the Mamba cache kind (a linear attention's conv and recurrent states), as upstream's
    MambaManager builds it: one state block per request (next_n 0), for the request's life; no slot mapping
    (prepare_slot_mapping emits none for it)."""

    def __init__(self, lengths):
        self.rows = [[1 + row] for row in range(len(lengths))]

    def grow(self, lengths):
        return None

    def table(self, width):
        import torch

        return torch.tensor(self.rows, dtype=torch.int32)


def randomise(model, scale: float) -> None:
    """Every parameter at the config's initializer_range: transformers' own initialisation leaves norms at 1 (0
    for gemma's 1 + w), biases, sinks and selection biases at 0, where a wrong formula would not show."""
    import torch

    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, tensor in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                                        if n.endswith("e_score_correction_bias"))]:
            if tensor.is_floating_point() and tensor.numel() and bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
        # decisive routers: few expert choices a tie at bfloat16's rounding (the verdict resolves ties itself; the
        # run-dtype job takes those left as given: RoutingTies)
        for router in routers(model):
            router.weight.mul_(ROUTER_GAIN)
            if getattr(router, "bias", None) is not None:
                router.bias.mul_(ROUTER_GAIN)


def routers(model) -> list:
    """The routers of the model's sparse-MoE blocks (their linears to the experts)."""
    import torch

    from agent.recipe.native.parts.moe import ROUTER_NAMES, moe_block
    from agent.recipe.native.parts.moe_scaled_router import layer_moe

    found = []
    for layer in getattr(getattr(model, "model", None), "layers", None) or []:
        block = moe_block(layer)
        if block is not None:
            found += [getattr(block[1], n) for n in ROUTER_NAMES if getattr(getattr(block[1], n, None), "weight", None)
                      is not None]
        elif layer_moe(layer):
            # a layer's own router (gemma4's): its linear to the experts
            found += [m for m in layer.router.children() if isinstance(m, torch.nn.Linear)]
    return found


def rope_by_length(config) -> bool:
    """Whether the config's rope (rope_parameters, or 5.0's rope_scaling; per layer type too) follows the length."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return False
    groups = [params] + [group for group in params.values() if isinstance(group, dict)]
    return any((group.get("rope_type") or group.get("type")) in LENGTH_DEPENDENT_ROPE for group in groups)


class Incremental:
    """transformers' logits of each sequence as it decodes: one cache per sequence, the new tokens only, and one
    copy of the model per sequence (a dynamic rope keeps the longest length it has seen: sequences decoded
    side by side in one model would share it)."""

    def __init__(self, model, rows: int):
        import copy

        import torch

        self.models = [model] + [copy.deepcopy(model) for _ in range(rows - 1)]
        self.caches, self.seen = [None] * rows, [0] * rows
        # a model whose forward keeps no cache (openai-gpt's) runs each step on the whole sequence; transformers
        # names the cache argument past_key_values (5.0) or cache (5.24)
        self.cached = bool({"past_key_values", "cache"} & set(inspect.signature(model.forward).parameters))
        # a model that carries a recurrent state in its cache (transformers' _is_stateful): each cached decode is held
        # to the whole sequence, since transformers' own cached path may be wrong (5.24's bamba: its Mamba2 decode
        # drifts from its own whole-sequence run to half the logits' range), and a wrong reference makes every check
        # vacuous; a row found so runs on the whole sequence from then on. Not where the rope follows the length:
        # there the two paths differ by design
        self.stateful = bool(getattr(model, "_is_stateful", False)) and not rope_by_length(model.config)
        self.whole = [False] * rows
        dtype = next(model.parameters()).dtype
        self.cache_tolerance = CACHE_TOLERANCE if dtype in (torch.float32, torch.float64) else CACHE_TOLERANCE_LOW
        self.start = None       # the position of the first token of the forward running (RoutingTies reads it)

    def logits(self, row: int, tokens: list[int]):
        try:
            return self._logits(row, tokens)
        finally:
            self.start = None

    def _logits(self, row: int, tokens: list[int]):
        import torch

        if not self.cached or self.whole[row]:
            self.start = 0
            with torch.no_grad():
                return self.models[row](input_ids=torch.tensor([tokens])).logits[0, -1].float()
        new = tokens[self.seen[row]:]
        decode = self.seen[row] > 0
        self.start = self.seen[row]
        with torch.no_grad():
            out = self.models[row](input_ids=torch.tensor([new]), past_key_values=self.caches[row], use_cache=True)
        self.caches[row], self.seen[row] = out.past_key_values, len(tokens)
        cached = out.logits[0, -1].float()
        if decode and self.stateful:
            self.start = 0
            with torch.no_grad():
                whole = self.models[row](input_ids=torch.tensor([tokens])).logits[0, -1].float()
            if not float((cached - whole).abs().max()) <= self.cache_tolerance * float(whole.abs().max()):
                self.whole[row] = True
                return whole
        return cached


def decoder_layers(model) -> list:
    """The decoder layers of transformers' model: its base model's, or its text decoder's (an image-text model)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    return list(getattr(decoder, "layers", None) or getattr(getattr(model, "model", None), "layers", None) or [])


def rounding_reach(weight, x, logits, weight_rounded: bool = True):
    """[experts]: the most rounding the router's `weight` (where the run dtype's model rounds it: not a router kept in
    float32), its input `x` [H] and its `logits` to the run dtype can move each logit (first order):
    RUN_DTYPE_ROUNDOFF x ((1 + weight_rounded) x sum_i |w_ei x_i| + |logit_e|)."""
    products = (weight.detach().float().abs() * x.detach().float().abs()[None, :]).sum(-1)
    return RUN_DTYPE_ROUNDOFF * ((1 + int(weight_rounded)) * products + logits.detach().float().abs())


def routing_tie(logits, reach, ours, gating: dict, bias=None) -> bool:
    """Whether the experts `ours` are a top-k of one token's router `logits` [experts] each moved by no more than
    `reach` [experts]: theirs raised by it and the others lowered, under `gating` (gating_of's: scoring, groups)
    and its selection `bias` (every selection is monotone in each logit, so that move favours them most)."""
    import torch

    from agent.recipe.native.parts.moe import selection

    experts = logits.shape[-1]
    if ours.unique().numel() != ours.numel() or int(ours.min()) < 0 or int(ours.max()) >= experts:
        return False        # an expert twice, or one the router has not: a wrong pick, never a tie
    picked = torch.zeros(experts, dtype=torch.bool)
    picked[ours] = True
    moved = logits.detach().float() + torch.where(picked, reach, -reach)
    _, choice = selection(moved[None], scoring=gating["scoring"], selection_bias=bias, n_group=gating["n_group"],
                          topk_group=gating["topk_group"], group_select=gating["group_select"])
    return bool(choice[0][picked].min() >= choice[0][~picked].max())


class RoutingTies:
    """The run dtype's MoE routing ties (see RUN_DTYPE_ROUNDOFF): the file's expert choice of each token at each
    MoE layer, read at its blocks' `gating` ((weights, expert ids)), and transformers' references steered to it at
    their experts' call (hidden states, top-k index, top-k weights) where the file's choice is a top-k of the float32
    reference's router logits moved by the rounding's reach (routing_tie). Where the file chose alike, or beyond that
    reach, nothing is steered: a wrong router's choices are no ties, and a dropped gate or norm moves the logits
    where the routing agrees too.
    `forced`: {(layer, row, position): the file's experts}, which the run-dtype reference takes too."""

    def __init__(self, model, references, config):
        import re

        import torch

        from agent.recipe.native.parts.moe import gating_of, moe_block

        self.file, self.calls, self.forced = {}, {}, {}
        self.gating = None
        layers = decoder_layers(references[0].models[0])
        if not any(moe_block(layer) for layer in layers):
            return
        try:
            self.gating = gating_of(config)
        except Exception:  # noqa: BLE001 - NotNative, or a probe that fails: no routing to steer, the plain rule
            return
        if self.gating["scoring"] not in ("softmax", "sigmoid") or self.gating.get("select_on_logits"):
            self.gating = None      # a gating the references are not steered under (phimoe's sparsemixer)
            return
        # the run dtype's reference rounds its routers' weights unless it keeps them in float32 (beam's, a
        # ROUTER_FP32 model's): then rounding moves a logit by its input's share alone
        self.weight_rounded = True
        if len(references) > 1:
            block = next((moe_block(layer) for layer in decoder_layers(references[1].models[0]) if moe_block(layer)),
                         None)
            if block is not None:
                router = block[1].get_submodule(self.gating.get("router_path", self.gating["router_name"]))
                self.weight_rounded = router.weight.dtype != torch.float32
        for name, module in model.named_modules():
            found = re.fullmatch(r"(?:.*\.)?layers\.(\d+)\..*", name)
            if found and callable(getattr(module, "gating", None)) and hasattr(module, "top_k"):
                module.gating = self._recorded(module.gating, int(found.group(1)))
        for reference, rounded in zip(references, (False, True)):
            for row, copy_ in enumerate(reference.models):
                for index, layer in enumerate(decoder_layers(copy_)):
                    block = moe_block(layer)
                    if block is not None:
                        block[1].experts.register_forward_pre_hook(
                            self._steer(reference, row, index, block[1], rounded), with_kwargs=True)

    def _recorded(self, gating, layer: int):
        def recorded(hidden_states):
            weights, expert_ids = gating(hidden_states)
            self.calls[layer] = expert_ids.detach().long().cpu()
            return weights, expert_ids
        return recorded

    def file_routed(self, tokens: list[tuple[int, int]]) -> None:
        """The file's forward just run held `tokens` ((row, position) of each of its token rows)."""
        for layer, ids in self.calls.items():
            if ids.shape[0] == len(tokens):
                for (row, position), choice in zip(tokens, ids):
                    self.file[(layer, row, position)] = choice.sort().values
        self.calls = {}

    def _steer(self, reference, row: int, layer: int, block, rounded: bool):
        import torch

        from agent.recipe.native.parts.moe import reference_gating, selection, selection_bias

        g = self.gating
        router = block.get_submodule(g.get("router_path", g["router_name"]))
        found = selection_bias(block, g["router_name"]) if g["selection_bias"] else None
        bias = found[0].reshape(-1) if found is not None else None

        def hook(module, args, kwargs):
            start = reference.start
            if start is None or len(args) < 3:
                return None
            hidden, index, weights = args[:3]
            with torch.no_grad():
                logits = torch.nn.functional.linear(hidden.to(router.weight.dtype), router.weight,
                                                    getattr(router, "bias", None))
                _, choice = selection(logits.float(), scoring=g["scoring"], selection_bias=bias,
                                      n_group=g["n_group"], topk_group=g["topk_group"], group_select=g["group_select"])
            k = index.shape[-1]
            own = index.long().sort(-1).values
            if not rounded and not torch.equal(own, choice.topk(k, dim=-1).indices.sort(-1).values):
                return None     # the hook's gating is not the block's: nothing steered (nor then in the run dtype)
            steer = []
            for p in range(hidden.shape[0]):
                key = (layer, row, start + p)
                ours = self.file.get(key)
                if ours is None or ours.shape[0] != k or torch.equal(ours, own[p]):
                    continue
                if key not in self.forced and not rounded:
                    reach = rounding_reach(router.weight, hidden[p], logits[p], self.weight_rounded)
                    tie = routing_tie(logits[p], reach, ours, g, bias)
                    if TRACE:
                        print(f"TIE layer {layer} row {row} position {start + p}: ours {ours.tolist()}, float32's "
                              f"{own[p].tolist()}, {'a tie' if tie else 'not a tie'}", file=sys.stderr)
                    if not tie:
                        continue
                    self.forced[key] = ours
                if key in self.forced:
                    steer.append(p)
            if not steer:
                return None
            chosen = index.clone()
            chosen[steer] = torch.stack([self.forced[(layer, row, start + p)] for p in steer]).to(index.dtype)
            forced_weights, _ = reference_gating(logits, k=k, scoring=g["scoring"], renormalize=g["renormalize"],
                                                 selection_bias=bias, n_group=g["n_group"], topk_group=g["topk_group"],
                                                 group_select=g["group_select"],
                                                 routed_scaling_factor=g["routed_scaling_factor"], index=chosen)
            weights = weights.clone()
            weights[steer] = forced_weights[steer].to(weights.dtype)
            return (hidden, chosen, weights, *args[3:]), kwargs

        return hook

    def line(self) -> str | None:
        """What the verdict says of the ties taken."""
        if not self.forced:
            return None
        tokens = len({(row, position) for _, row, position in self.forced})
        return (f"{len(self.forced)} expert choice{'s' if len(self.forced) != 1 else ''} of {tokens} "
                f"token{'s' if tokens != 1 else ''} a tie below {RUN_DTYPE}'s rounding; the reference took ours")


def float64_logits(reference, row: int, tokens: list[int]):
    """transformers' float64 logits of `tokens`' last position: the whole sequence at once on a float64 copy of the
    row's model, the experts in their own loop (grouped_mm takes no float64); None where the model has no float64
    copy (a quantized reference)."""
    import copy

    import torch

    try:
        double = copy.deepcopy(reference.models[row]).double()
        for module in double.modules():
            if getattr(module, "config", None) is not None and hasattr(module.config, "_experts_implementation"):
                module.config._experts_implementation = "eager"
        with torch.no_grad():
            return double(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def float32_judgement(got, expected, scale: float, exact) -> tuple[float, float | None, float]:
    """(|got - expected|, |got - float64| or None, the allowance) of a float32 step: the file's logits `got` against
    transformers' float32 `expected` of largest |logit| `scale`; `exact()` gives transformers' float64 logits (None:
    no float64 copy), run only where `got` is over TOLERANCE of `expected`. The step passes where either difference
    is within the allowance: TOLERANCE x scale, or FLOAT32_SLACK x transformers' own float32 error (|expected -
    float64|) where that is larger."""
    error = float((got - expected).abs().max())
    allowed = TOLERANCE * scale
    if error <= allowed:
        return error, None, allowed
    exact = exact()
    if exact is None:
        return error, None, allowed
    # transformers' own float32 may be off by more (an ill-conditioned config: granite's attention_multiplier 1.0
    # sharpens every softmax): its float64 logits set the floor
    allowed = max(allowed, FLOAT32_SLACK * float((expected.double() - exact).abs().max()))
    # and the truth: the file against transformers' float32 is two float32 roundings of one model against each
    # other (each about `own` from float64, so up to (1 + FLOAT32_SLACK) x own apart where both are right); a file
    # as near to float64 as transformers' float32 may be is right (jamba's, granitemoeshared's 0.75 multipliers:
    # 1.18 and 1.16 x the allowance from transformers' float32, 0.95 and 0.66 x from float64). A fault moves the
    # file from both alike
    return error, float((got.double() - exact).abs().max()), allowed


def reference_model(config):
    """transformers' causal-LM model of `config` in float32, on a copy of it: its modules read their attention and
    experts implementation from the config they hold, so models built on one config object switch together
    (a model switched to another implementation would move the others too)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()


def checkpoint_tensors(reference, config) -> list:
    """The tensors a checkpoint of `reference` holds, named as save_pretrained writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    tensors = revert_weight_conversion(reference, dict(reference.state_dict()))
    output, embedding = reference.get_output_embeddings(), reference.get_input_embeddings()
    if getattr(config, "tie_word_embeddings", False) or (output is not None and output.weight is embedding.weight):
        tensors.pop("lm_head.weight", None)        # a tied checkpoint: the output embedding is the input one
    return list(tensors.items())


def quantized_reference(checkpoint: str, dtype: str):
    """(config, [transformers in float32, in `dtype`], the checkpoint's tensors as stored, the config the native
    model is built on): transformers loading the quantized checkpoint with its own quantizer (compressed-tensors:
    int8 weights dequantized, activations quantized per token as its scheme says), the native model given
    `quant_config` as upstream's executor sets it (module.quantization.get_quant_config on the checkpoint's
    quantization_config)."""
    import glob

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from agent.recipe.text_decoder import transformers_auto_class
    from module.quantization import get_quant_config

    config = AutoConfig.from_pretrained(checkpoint)
    # executor.model_runner's _verify_quantization: the method named by the checkpoint's config
    method = getattr(config, "quantization_config", None) or getattr(config, "compression_config", None) or {}
    name = str(method.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    model_config = AutoConfig.from_pretrained(checkpoint)
    model_config.quant_config = get_quant_config(model_config, name, checkpoint)
    auto_class = transformers_auto_class(checkpoint)

    def load(run_dtype):
        model = auto_class.from_pretrained(checkpoint, dtype=run_dtype).eval()
        # transformers 5.0 leaves the float experts a compressed-tensors checkpoint keeps (its `ignore`) in the
        # file's dtype when it merges them: the float parameters in the dtype asked for (int8 weights stay)
        return model.to(run_dtype)

    references = [Incremental(load(torch.float32), len(PROMPT_LENGTHS))]
    if dtype != "float32":
        references.append(Incremental(load(getattr(torch, dtype)), len(PROMPT_LENGTHS)))
    tensors = [item for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors")))
               for item in load_file(path).items()]
    return config, references, tensors, model_config


def check(job: dict) -> dict:
    import torch

    from agent.recipe.text_decoder import image_text_model, text_decoder
    from agent.precision_rule import tolerance
    from agent.recipe.native.parts.probe import shrunk_config
    from executor.utils.forward_metadata import ForwardMetaData

    dtype = job.get("dtype", "float32")
    torch.set_default_dtype(torch.float32)
    if job.get("checkpoint"):
        # a quantized checkpoint as written: transformers' own loader of it is the reference
        config, references, tensors, model_config = quantized_reference(job["checkpoint"], dtype)
    else:
        # an image-text checkpoint: its text decoder's file, held to transformers' image-text model on text-only
        # prompts (a family variant of the decoder's config: to its causal-LM class)
        decoder = text_decoder(job["config"])
        text = decoder.config if decoder is not None else job["config"]
        config = shrunk_config(text, job.get("changes"))
        torch.manual_seed(job.get("seed", 0))
        if decoder is not None and not job.get("changes"):
            # the file built on the decoder's own config class, as the recipe registers it (Qwen2.5-VL's text
            # config: its M-RoPE sections in rope_parameters), the widths of `config`
            text = decoder.own_config

            def build():
                return image_text_model(decoder, job["config"], shrunk_config(decoder.own_config))
        else:
            def build():
                return reference_model(config)
        reference = by_reference(build)
        randomise(reference, float(getattr(config, "initializer_range", 0.02) or 0.02))
        references = [Incremental(reference, len(PROMPT_LENGTHS))]
        if dtype != "float32":
            rounded = by_reference(build)
            rounded.load_state_dict(reference.state_dict())
            references.append(Incremental(rounded.to(getattr(torch, dtype)), len(PROMPT_LENGTHS)))
        tensors, model_config = checkpoint_tensors(reference, config), shrunk_config(text, job.get("changes"))
    module = _import(job["file"], f"native_selfcheck_{job.get('index', 0)}")
    model_class = getattr(module, job["class_name"])
    torch.set_default_dtype(getattr(torch, dtype))      # the executor builds the model in the run dtype
    try:
        model = model_class(model_config, _infer_config(BLOCK_SIZE), _SingleRank(), "").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    # the run dtype's MoE routing ties: the references steered to the file's choice where it is one (RoutingTies)
    ties = RoutingTies(model, references, config) if dtype != "float32" else None
    loaded = model.load_weights(tensors)
    # module.quantization's parameters a checkpoint may omit (smoothing factors, ones) are no missing weight
    missing = sorted(name for name in set(dict(model.named_parameters())) - set(loaded)
                     if not name.endswith(getattr(module, "QUANT_DEFAULTS", ())))
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
        if entry.attn_type == MAMBA:
            # a state block held another request's state before: NaN, which a prefill must not read
            caches.append(torch.full((blocks, *entry.shape), float("nan"), dtype=entry.dtype))
        else:
            caches.append(torch.zeros(blocks, BLOCK_SIZE, entry.num_head, entry.dim, dtype=entry.dtype))
        entry.tensor_setter(caches[-1])

    def poison_null_block():
        # every sequence's positions before its window are written to the null block (upstream's
        # prepare_slot_mapping), so it holds anything: NaN before each step
        for cache in caches:
            cache[0] = float("nan")
    kinds = {entry.attn_type: entry.sliding_window for entry in entries}
    tables = {kind: StateTables(lengths) if kind == MAMBA else PagedTables(window, BLOCK_SIZE, lengths)
              for kind, window in kinds.items()}
    vocab = config.vocab_size
    sequences = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    mask = ~torch.tril(torch.ones((2048, 2048), dtype=torch.bool))
    worst = {"rel": 0.0, "ratio": 0.0, "by_float64": 0}

    def compare(step, logits):
        for row, tokens in enumerate(sequences):
            expected = [by_reference(ref.logits, row, tokens) for ref in references]
            got = logits[row].reshape(-1).float()
            scale = float(expected[0].abs().max().clamp_min(1e-6))
            truth = None
            if dtype == "float32":
                error, truth, allowed = float32_judgement(
                    got, expected[0], scale, lambda: float64_logits(references[0], row, tokens))
            else:       # the precision verdict's rule at this step
                error = float((got - expected[0]).abs().max())
                allowed = RUN_DTYPE_SLACK * tolerance(float((expected[1] - expected[0]).abs().max()), scale, dtype)
            judged = truth if truth is not None and truth < error else error
            if TRACE:
                own = float((expected[-1] - expected[0]).abs().max())
                print(f"TRACE {step} row {row} error {error:.4g} own {own:.4g} allowed {allowed:.4g} scale {scale:.4g}"
                      f"{'' if truth is None else f' from float64 {truth:.4g}'}", file=sys.stderr)
            for key, value in (("rel", error / scale), ("ratio", judged / allowed)):
                worst[key] = max(worst[key], value if math.isfinite(value) else float("inf"))
            if truth is not None and truth <= allowed < error:
                worst["by_float64"] += 1
            if not judged <= allowed:
                from_exact = "" if truth is None else f" ({truth:.3g} from its float64 logits)"
                taken = ties.line() if ties is not None else None
                raise AssertionError(f"{step}, sequence {row} ({len(tokens)} tokens, {dtype}): logits differ from "
                                     f"transformers' by {error:.3g}{from_exact}, over the tolerance {allowed:.3g}"
                                     f"{f' ({taken})' if taken else ''}")
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
        slot_mapping={k: torch.cat([t.slots(r, range(n)) for r, n in enumerate(lengths)]) for k, t in tables.items()
                      if k != MAMBA})
    poison_null_block()
    with torch.no_grad():
        logits = model(ids, positions, meta)
    if ties is not None:
        ties.file_routed([(row, position) for row, n in enumerate(lengths) for position in range(n)])
    next_tokens = compare("prefill", logits)
    for step in range(DECODE_STEPS if dtype == "float32" else RUN_DTYPE_DECODE_STEPS):
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
            slot_mapping={k: torch.cat([t.slots(r, [n - 1]) for r, n in enumerate(lengths)]) for k, t in tables.items()
                          if k != MAMBA})
        poison_null_block()
        with torch.no_grad():
            logits = model(torch.tensor(next_tokens), torch.tensor([n - 1 for n in lengths]), meta)
        if ties is not None:
            ties.file_routed([(row, n - 1) for row, n in enumerate(lengths)])
        next_tokens = compare(f"decode step {step + 1}", logits)
    taken = ties.line() if ties is not None else None
    return {"ok": True, "max_rel": worst["rel"], "ratio": worst["ratio"], "by_float64": worst["by_float64"],
            "reason": None, **({"routing_ties": len(ties.forced), "note": taken} if taken else {})}


def main(argv: list[str]) -> int:
    jobs = load_json(argv[0])
    results = []
    for index, job in enumerate(jobs):
        job.setdefault("index", index)
        try:
            results.append(check(job))
        except AssertionError as exc:
            results.append({"ok": False, "max_rel": None, "reason": str(exc)})
        except ReferenceFailed as exc:
            results.append({"ok": False, "checkable": False, "max_rel": None, "reason": str(exc)})
        except Exception as exc:  # noqa: BLE001 - any failure of the generated file is a reason to fall back
            last = traceback.extract_tb(exc.__traceback__)[-1]
            results.append({"ok": False, "max_rel": None,
                            "reason": f"{type(exc).__name__}: {exc} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"})
    print("SELFCHECK " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
