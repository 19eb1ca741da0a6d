"""The generated sparse-MoE block (agent/recipe/native/parts/code/moe.py, written by
agent.recipe.native.parts.moe.render_moe) against transformers' own MoE block on a shrunk config, fp32, under the stand-in's reference kernels (torch.ops.npu, their torch_npu
schemas). Used in-process by tests/unit/agent/recipe/native/test_moe_features.py and, as a script, by its 2-rank run:

    python -m torch.distributed.run --nproc-per-node=2 tests/support/native_moe_harness.py CASE OUT.json
    python -m torch.distributed.run --nproc-per-node=N tests/support/native_moe_harness.py CASE OUT.json \
        --layouts A:M[,A:M...] [--fault NAME]

The second runs the block at each layout of N ranks (attn_tp_size A, moe_tp_size M; moe_ep_size = N // M as
upstream derives it), its groups registered by the block's own register_expert_groups on a comm manager that
partitions the ranks as upstream's CommManager does, at a prefill (prompts of unequal length: each attention
data-parallel group its own tokens, the all-to-all double routing) and a decode (the MC2 dispatch / combine):
every rank's output against transformers' block on that rank's own tokens.

The checkpoint tensors are the ones transformers writes (save_pretrained's `revert_weight_conversion` turns
its fused 3-D experts back into the checkpoint's per-expert names, and its block under the checkpoint's name,
which the native file's transformers renames, agent.recipe.native.parts.model.checkpoint_renames, turn back),
loaded through the block's own load_weights."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
# the shared upstream snapshot beside the checkout (../shared), or beside the worktrees' folder (../../shared)
UPSTREAM = next((p / "shared" / "upstream" / "cann-recipes-infer" for p in REPO_ROOT.parents[:2]
                 if (p / "shared" / "upstream" / "cann-recipes-infer").is_dir()),
                REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer")
TOKENS = 13
SHRUNK = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=48, num_hidden_layers=2, vocab_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)

# model_type and the config facts that choose its routing code paths
CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_moe_unnormalised": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    # 256 experts: npu_moe_gating_top_k's fused kernel; 64: the plain-torch gate (upstream's condition)
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8,
                                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                        norm_topk_prob=True)),
    "deepseek_v3_64": ("deepseek_v3", dict(n_routed_experts=64, n_group=4, topk_group=2, num_experts_per_tok=4,
                                           n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                           norm_topk_prob=True)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, swiglu_limit=7.0)),
    # the block as block_sparse_moe, its experts stored fused (input_linear / output_linear, renamed by transformers)
    "granitemoe": ("granitemoe", dict(num_local_experts=8, num_experts_per_tok=2)),
    # the selection bias as [1, E] under the router's moe_statics, the layers by moe_layer_start_index / interval
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_num_shared_experts=2,
                                          moe_layer_start_index=1, moe_layer_interval=1)),
    # sigmoid with the block's own selection bias, scaled by router_scaling_factor, num_shared_experts
    "hy_v3": ("hy_v3", dict(num_experts=8, num_experts_per_tok=2, num_shared_experts=1, router_scaling_factor=2.5,
                            mlp_layer_types=["dense", "sparse"])),
    # shared experts intermediate_size x moe_num_shared_experts wide; experts stored fused as [E, H, 2I] (fc1 / fc2)
    "aria_text": ("aria_text", dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=2)),
    # grouped sigmoid routing, shared experts moe_intermediate_size x num_shared_experts wide
    "exaone_moe": ("exaone_moe", dict(num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                      num_shared_experts=1, routed_scaling_factor=2.5,
                                      mlp_layer_types=["dense", "sparse"])),
    # the router nested as gate.wg (fp32), moe_topk per layer (the block reads its layer's), the shared_mlp in the block
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(num_experts=8, moe_topk=[3, 2])),
    # phimoe's sparsemixer: two rounds of a softmax over the experts near the best
    "phimoe": ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.5)),
    # the selection bias added to the logits, the weights their sigmoid renormalised, the router in fp32
    "kolibri1": ("kolibri1", dict(num_experts=8, num_experts_per_tok=2)),
    # the sigmoid weight of the top-1 expert scaling that expert's input (not its output), a shared expert beside
    "llama4_text": ("llama4_text", dict(num_local_experts=8, num_experts_per_tok=1)),
    # its router's logits large enough that their sigmoids round to a tie at 1: the top-k of the logits decides
    "llama4_text_saturated": ("llama4_text", dict(num_local_experts=8, num_experts_per_tok=1)),
}
# a case's router weights times this after the random ones (SATURATED: many sigmoids of the logits round to 1)
ROUTER_GAINS = {"llama4_text_saturated": 64.0}


def torch_npu_module() -> types.ModuleType:
    """`torch_npu` whose npu_* calls are the stand-in's registered reference kernels."""
    from npu_standin import kernels

    kernels.install()
    module = types.ModuleType("torch_npu")
    module.__getattr__ = lambda name: getattr(torch.ops.npu, name)
    return module


_TORCH_NPU: list = []


@contextlib.contextmanager
def torch_npu_importable():
    """`import torch_npu` gives the reference-kernel module while upstream's layers and the generated
    file are imported, and only then: left in sys.modules, transformers would take this host for an NPU."""
    if not _TORCH_NPU:
        _TORCH_NPU.append(torch_npu_module())
    # executor.utils imports torchair at module level and calls it only in graph mode, which the block never enters
    shims = {"torch_npu": _TORCH_NPU[0], "torchair": types.ModuleType("torchair")}
    saved = {name: sys.modules.get(name) for name in shims}
    sys.modules.update(shims)
    try:
        yield _TORCH_NPU[0]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def ensure_imports() -> None:
    import transformers.activations  # noqa: F401 - what upstream's layers import, imported before torch_npu exists
    from transformers import AutoModelForCausalLM  # noqa: F401
    if importlib.util.find_spec("accelerate") is not None:
        importlib.import_module("accelerate")      # it asks whether torch_npu exists when imported
    if str(UPSTREAM) not in sys.path:
        sys.path.insert(0, str(UPSTREAM))
    with torch_npu_importable():
        importlib.import_module("module.fuse_moe_gmm")
        importlib.import_module("module.linear")
        # the block's MC2 buffer size and forward metadata; executor.utils names torch.npu.Event in an annotation
        # at import, and nothing else of torch.npu until a graph-mode call the block never makes
        torch.npu = types.SimpleNamespace(Event=object)
        try:
            importlib.import_module("executor.utils")
            importlib.import_module("executor.utils.forward_metadata")
        finally:
            del torch.npu


def shrunk_config(case: str):
    from transformers import AutoConfig

    model_type, overrides = CASES[case]
    config = AutoConfig.for_model(model_type, **SHRUNK, **overrides)
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    return config


def reference(case: str, seed: int = 0, fused_names: bool = False):
    """(config, transformers' MoE block of the first sparse layer, the checkpoint's tensors of that block
    named relative to it, the block's facts: agent.recipe.native.parts.moe.derive_moe)."""
    import re

    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from agent.recipe.native.parts.model import checkpoint_renames
    from agent.recipe.native.parts.moe import derive_moe

    config = shrunk_config(case)
    facts = derive_moe(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.3)
    layer = facts["sparse_layers"][0]
    block = getattr(model.model.layers[layer], facts["block_name"])
    if case in ROUTER_GAINS:
        with torch.no_grad():
            block.get_submodule(facts["router_path"]).weight.mul_(ROUTER_GAINS[case])
    # what save_pretrained writes (its fused experts turned back into the checkpoint's names), on every
    # rank (save_pretrained itself writes on one rank only under torch.distributed); renamed as the file does
    tensors = dict(model.state_dict()) if fused_names else revert_weight_conversion(model, dict(model.state_dict()))
    renames = checkpoint_renames(config.model_type)

    def renamed(name):
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name, count=1)
        return name
    prefix = f"model.layers.{layer}.{facts['block_name']}."
    checkpoint = {renamed(k)[len(prefix):]: v for k, v in tensors.items() if renamed(k).startswith(prefix)}
    return config, block, checkpoint, facts


def load_generated(source: str, name: str):
    ensure_imports()
    folder = Path(tempfile.mkdtemp(prefix="native_moe_"))
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"native_moe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    with torch_npu_importable():
        spec.loader.exec_module(module)
    return module


class WorldComm:
    """The two calls the block makes on upstream's CommManager, over the default (gloo) group."""

    def get_rank(self, name):
        return torch.distributed.get_rank()

    def get_group(self, name):
        return torch.distributed.group.WORLD


def infer_config(moe_tp_size: int = 1, world_size: int | None = None, attn_tp_size: int | None = None,
                 batch_size: int = 1, custom_params: dict | None = None):
    """upstream's InferenceConfig as the block reads it: world_size and attn_tp_size default to moe_tp_size;
    moe_ep_size, attn_dp_size and batch_size_per_dp_rank derived as upstream's ParallelConfig and InferenceConfig
    derive them."""
    world_size = world_size or moe_tp_size
    attn_tp_size = attn_tp_size or world_size
    parallel = types.SimpleNamespace(world_size=world_size, attn_tp_size=attn_tp_size, moe_tp_size=moe_tp_size,
                                     moe_ep_size=world_size // moe_tp_size, attn_dp_size=world_size // attn_tp_size,
                                     embed_tp_size=1, lmhead_tp_size=1)
    scheduler = types.SimpleNamespace(batch_size=batch_size, batch_size_per_dp_rank=batch_size // parallel.attn_dp_size)
    return types.SimpleNamespace(parallel_config=parallel, scheduler_config=scheduler, model_config=types.SimpleNamespace(
        enable_weight_nz=False, next_n=0, platform_version="A3", custom_params=dict(custom_params or {})))


class LayoutComm:
    """upstream's CommManager as the generated file calls it (register_group, get_group, get_rank, get_group_name),
    over gloo: the subgroups partitioned by upstream's own rule (CommManager._build_strided_subgroups), every rank
    creating every subgroup (a collective); the MC2 group's name the stand-in's HCCL communicator name."""

    def __init__(self):
        self.groups: dict = {}

    @staticmethod
    def subgroups(group_num, group_size, group_stride=1):
        """upstream's CommManager._build_strided_subgroups without start_ranks (executor.core's package imports
        the whole engine): consecutive blocks at stride 1, interleaved groups at a larger stride."""
        starts = [g * group_size for g in range(group_num)] if group_stride == 1 else list(range(group_num))
        return [[start + i * group_stride for i in range(group_size)] for start in starts]

    def register_group(self, name, group_num, group_size, group_stride=1, return_name=False, **_):
        from npu_standin.dist import hccl_comm_name

        rank = torch.distributed.get_rank()
        for ranks in self.subgroups(group_num, group_size, group_stride):
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                self.groups[name] = (group, ranks.index(rank), hccl_comm_name(group) if return_name else None)

    def get_group(self, name):
        return self.groups[name][0]

    def get_rank(self, name):
        return self.groups[name][1]

    def get_group_name(self, name):
        return self.groups[name][2]


# faults a multi-rank check must catch: (text of the correct block, its faulty replacement)
LAYOUT_FAULTS = {
    # each EP rank loads the next rank's experts: an expert's tokens computed by another rank's expert
    "experts of the next EP rank": ("self.first_expert = self.ep_rank * self.local_experts",
                                    "self.first_expert = (self.ep_rank + 1) % self.ep_size * self.local_experts"),
    # the MoE-TP partials of different requests summed (attention DP under moe_tp_group, nothing gathered)
    "moe_tp all-reduce across requests": ("self.gather = spans_requests(self.tp_size, parallel.attn_tp_size)",
                                          "self.gather = False"),
}
LAYOUT_OPS = ("npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_moe_re_routing",
              "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")


def run_layouts(case: str, layouts: list[tuple[int, int]], fault: str | None = None) -> dict:
    """The block at each (attn_tp_size, moe_tp_size) layout of this torch.distributed world, each rank's output
    against transformers' block on that rank's own tokens, at a prefill and a decode: {layout: {phase: the
    largest relative difference over the ranks}, "ops": kernels called}."""
    from agent.recipe.native.parts.moe import render_moe

    ensure_imports()
    from executor.utils.forward_metadata import set_forward_metadata

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    config, block, checkpoint, facts = reference(case)
    source = render_moe(facts)
    if fault is not None:
        correct, faulty = LAYOUT_FAULTS[fault]
        assert source.count(correct) == 1, fault
        source = source.replace(correct, faulty)
    module = load_generated(source, f"{case}_layouts")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("SparseMoeBlock"))
    calls: list = []
    torch_npu = _TORCH_NPU[0]
    for n in LAYOUT_OPS:
        op = getattr(torch.ops.npu, n)
        setattr(torch_npu, n, (lambda n, op: lambda *a, **k: (calls.append(n), op(*a, **k))[1])(n, op))
    results: dict = {}
    for attn_tp, moe_tp in layouts:
        settings = infer_config(moe_tp_size=moe_tp, world_size=world, attn_tp_size=attn_tp, batch_size=4 * world)
        comm = LayoutComm()
        comm.register_group(name="attn_tp_group", group_num=world // attn_tp, group_size=attn_tp)
        module.register_expert_groups(comm, config, settings)
        ours = cls(config, settings, comm, prefix=f"model.layers.{facts['sparse_layers'][0]}.mlp")
        ours.load_weights(list(checkpoint.items()))
        ours.process_weights_after_loading()
        dp_rank = rank // attn_tp         # the attention data-parallel group: its own requests
        row = {}
        for phase, tokens in (("prefill", TOKENS + 3 * dp_rank), ("decode", 4)):
            torch.manual_seed(100 + dp_rank)
            x = torch.randn(tokens, config.hidden_size)
            set_forward_metadata(is_prefill=phase == "prefill")
            with torch.no_grad():
                got = ours(x)
                want = block(x[None])
            want = (want[0] if isinstance(want, tuple) else want).reshape(tokens, -1)
            rel = torch.tensor([(got.float() - want.float()).abs().max().item() / want.abs().max().item()])
            torch.distributed.all_reduce(rel, op=torch.distributed.ReduceOp.MAX)
            row[phase] = rel.item()
        results[f"attn_tp {attn_tp} moe_tp {moe_tp}"] = row
    results["ops"] = sorted(set(calls))
    return results


def run(case: str, *, features=None, source_edit=None, checkpoint_edit=None, moe_tp_size: int = 1,
        tokens: int = TOKENS, fused_names: bool = False, custom_params: dict | None = None) -> dict:
    """Ours against transformers' block on the same tokens: {"max_abs", "rel", "ops"}; `features`: facts to
    write the block from in place of the derived ones."""
    from agent.recipe.native.parts.moe import render_moe

    config, block, checkpoint, derived = reference(case, fused_names=fused_names)
    features = features or derived
    source = render_moe(features)
    if source_edit is not None:
        source = source_edit(source)
    module = load_generated(source, case)
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("SparseMoeBlock"))
    comm = WorldComm() if moe_tp_size > 1 else None
    # the layer's own prefix: a block reading a per-layer config entry (hunyuan_v1_moe's moe_topk) reads the layer's
    ours = cls(config, infer_config(moe_tp_size, custom_params=custom_params), comm,
               prefix=f"model.layers.{derived['sparse_layers'][0]}.mlp")
    items = list(checkpoint.items())
    if checkpoint_edit is not None:
        items = checkpoint_edit(items)
    loaded = ours.load_weights(items)
    ours.process_weights_after_loading()
    unloaded = sorted(set(dict(ours.named_parameters())) - loaded)
    torch.manual_seed(1)
    x = torch.randn(tokens, config.hidden_size)
    calls = []
    counted = {n: getattr(torch.ops.npu, n) for n in ("npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k",
                                                       "npu_moe_init_routing_v2", "npu_grouped_matmul",
                                                       "npu_moe_finalize_routing", "npu_swiglu")}
    torch_npu = _TORCH_NPU[0]
    previous = torch_npu.__dict__.copy()
    for n, op in counted.items():
        setattr(torch_npu, n, (lambda n, op: lambda *a, **k: (calls.append(n), op(*a, **k))[1])(n, op))
    try:
        with torch.no_grad():
            got = ours(x)
            want = block(x[None])
    finally:
        for n in counted:
            if n in previous:
                setattr(torch_npu, n, previous[n])
            else:
                delattr(torch_npu, n)
    want = (want[0] if isinstance(want, tuple) else want).reshape(tokens, -1)
    diff = (got.float() - want.float()).abs().max().item()
    return {"max_abs": diff, "rel": diff / want.abs().max().item(), "ops": sorted(set(calls)),
            "calls": {n: calls.count(n) for n in set(calls)},
            "unloaded": unloaded, "shape": list(got.shape)}


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layouts", help="attn_tp_size:moe_tp_size, comma-separated")
    parser.add_argument("--fault", choices=sorted(LAYOUT_FAULTS))
    args = parser.parse_args()
    case, out = args.case, args.out
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if args.layouts:
        layouts = [tuple(int(n) for n in item.split(":")) for item in args.layouts.split(",")]
        result = run_layouts(case, layouts, args.fault)
    else:
        result = run(case, moe_tp_size=world)
    if rank == 0:
        out.write_text(json.dumps(result))
    from tests.support.rank_exit import end_rank

    end_rank(0)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
