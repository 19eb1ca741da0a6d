"""agent/recipe/layouts.py: which communication groups a framework recipe's code certainly gets at a layout
and never registers there, read from the code. Table-driven on model files in upstream's shape (the
conditions, aliases and call chains upstream's qwen3_moe / gpt_oss / deepseek_r1 use), each with a layout
it must name and one it must pass; upstream's own files in the snapshot at every layout its YAMLs scale to."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from agent.recipe.layouts import CodeFacts, describe, problems

# models/qwen3_moe's shape: EP path whenever moe_tp_size is 1, its group registered only for moe_ep_size > 1
EP_BY_DEFAULT = '''
class SparseMoeBlock(nn.Module):
    def __init__(self, config, infer_config, comm_manager):
        self.moe_tp_size = infer_config.parallel_config.moe_tp_size
        self.moe_ep_size = infer_config.parallel_config.moe_ep_size
        self.ep_size = self.moe_ep_size
        self.experts = Experts(ep_rank=comm_manager.get_rank("moe_ep_group") if self.ep_size > 1 else 0)

    def forward(self, hidden_states):
        is_prefill = get_forward_metadata().is_prefill
        if self.moe_tp_size > 1:
            return self.moe_infer_tp(hidden_states)
        else:
            if is_prefill:
                return self.moe_infer_double_routing(hidden_states)
            else:
                return self.moe_infer_dispatch_combine(hidden_states)

    def moe_infer_tp(self, hidden_states):
        return dist.all_reduce(hidden_states, group=self.comm_manager.get_group("moe_tp_group"))

    def moe_infer_double_routing(self, hidden_states):
        return self.dispatch(hidden_states)

    def dispatch(self, hidden_states):
        group = self.comm_manager.get_group("moe_ep_group")
        return hidden_states

    def moe_infer_dispatch_combine(self, hidden_states):
        return hidden_states


class ForCausalLM(nn.Module):
    def __init__(self, config, infer_config, comm_manager):
        self.world_size = infer_config.parallel_config.world_size
        self.moe_tp_size = infer_config.parallel_config.moe_tp_size
        self.moe_ep_size = infer_config.parallel_config.moe_ep_size
        self.init_parallel_comm_group()

    def init_parallel_comm_group(self):
        if self.moe_tp_size > 1:
            self.comm_manager.register_group(name="moe_tp_group", group_num=1, group_size=self.moe_tp_size)
        if self.moe_ep_size > 1:
            self.comm_manager.register_group(name="moe_ep_group", group_num=1, group_size=self.moe_ep_size)
'''
# models/gpt_oss's shape: the use behind a flag set from the layout (not a setting): never certain
BEHIND_A_FLAG = '''
class Experts(nn.Module):
    def __init__(self, infer_config):
        self.moe_tp_size = infer_config.parallel_config.moe_tp_size
        self.commute_type = "all_reduce" if self.moe_tp_size > 1 else "no_commute"
        if self.moe_tp_size > 1:
            comm_manager.register_group(name="moe_tp_group", group_num=1, group_size=self.moe_tp_size)

    def forward(self, x):
        if self.commute_type == "all_reduce":
            dist.all_reduce(x, group=self.comm_manager.get_group("moe_tp_group"))
        return x
'''
# an early return guards what follows; a group registered unconditionally somewhere is never named
EARLY_RETURN = '''
class Attention(nn.Module):
    def __init__(self, infer_config):
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        comm_manager.register_group("attn_tp_group", group_num=1, group_size=1)
        if self.attn_tp_size > 1:
            comm_manager.register_group(name="o_proj_group", group_num=1, group_size=2)

    def forward(self, x):
        out = self.reduce(x)
        return out

    def reduce(self, x):
        if self.attn_tp_size == 1:
            return x
        dist.all_reduce(x, group=self.comm_manager.get_group("o_proj_group"))
        return dist.all_reduce(x, group=self.comm_manager.get_group("attn_tp_group"))
'''


def layout(world_size, attn_tp=1, moe_tp=1):
    return {"world_size": world_size, "attn_tp_size": attn_tp, "moe_tp_size": moe_tp, "embed_tp_size": 1,
            "lmhead_tp_size": world_size}


def facts(tmp_path: Path, code: str) -> CodeFacts:
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "models" / "modeling_x.py").write_text(textwrap.dedent(code))
    return CodeFacts.of(tmp_path)


@pytest.mark.parametrize("code,parallel,groups", [
    (EP_BY_DEFAULT, layout(1), ["moe_ep_group"]),             # moe_tp 1, moe_ep 1: the EP path, no EP group
    (EP_BY_DEFAULT, layout(2), []),                           # moe_ep 2: registered
    (EP_BY_DEFAULT, layout(2, 2, 2), []),                     # moe_tp 2: the TP path
    (EP_BY_DEFAULT, layout(4, 4, 2), []),                     # moe_tp 2, moe_ep 2
    (BEHIND_A_FLAG, layout(1), []),                           # a flag it cannot read: not certain
    (BEHIND_A_FLAG, layout(2, 2, 2), []),
    (EARLY_RETURN, layout(1), []),                            # returned before the use at attn_tp 1
    (EARLY_RETURN, layout(2, 2, 2), []),
])
def test_groups_its_code_gets_and_never_registers_at_the_layout(tmp_path, code, parallel, groups):
    found = problems(facts(tmp_path, code), parallel)
    assert [line.split("'")[1] for line in found] == groups, found
    if groups:
        assert found[0].startswith("its code gets the communication group 'moe_ep_group' (models/modeling_x.py:")
        assert "only where `self.moe_ep_size > 1` (models/modeling_x.py:" in found[0]


def test_the_early_return_inverted_is_named(tmp_path):
    """The same file with the return on the other branch: at attn_tp 2 the use is reached and its group,
    registered only for attn_tp > 1, is there; at attn_tp 1 it is reached and is not."""
    code = EARLY_RETURN.replace("if self.attn_tp_size == 1:\n            return x",
                                "if self.attn_tp_size > 1:\n            return x")
    assert problems(facts(tmp_path, code), layout(2, 2, 2)) == []
    assert [line.split("'")[1] for line in problems(facts(tmp_path, code), layout(1))] == ["o_proj_group"]


def test_moe_ep_size_is_derived_as_upstreams_inference_config_does(tmp_path):
    """moe_ep_size is never in a YAML: world_size // moe_tp_size (executor/core/config/inference_config.py)."""
    assert describe(layout(1)) == "1 rank (attn_tp 1, moe_tp 1, so moe_ep 1)"
    assert describe(layout(8, 2, 2)) == "8 ranks (attn_tp 2, moe_tp 2, so moe_ep 4)"
    code = facts(tmp_path, EP_BY_DEFAULT)
    assert problems(code, {**layout(1), "moe_ep_size": 4}) != []        # a stale moe_ep_size is not believed


def test_unreadable_or_absent_model_code_names_nothing(tmp_path):
    assert problems(CodeFacts.of(tmp_path), layout(1)) == []
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "modeling_x.py").write_text("def broken(:\n")
    assert problems(CodeFacts.of(tmp_path), layout(1)) == []


UPSTREAM = Path(__file__).resolve().parents[4].parent / "shared" / "upstream" / "cann-recipes-infer" / "models"


@pytest.mark.parametrize("model,parallel,groups", [
    ("qwen3_moe", layout(1), {"moe_ep_group", "moe_ep_group_mc2"}),
    ("qwen3_moe", layout(2, 2, 2), set()),                 # its 16tp YAML at 2 ranks: the TP MoE path
    ("qwen3_moe", layout(2), set()),                       # its 128ep YAML at 2 ranks: the groups are there
    ("deepseek_r1", layout(1), {"moe_ep_group_mc2"}),
    ("deepseek_r1", layout(2, 2, 2), set()),
    ("gpt_oss", layout(1), set()),                         # runs at one rank (tests/e2e/test_upstream_recipes_standin.py)
    ("qwen", layout(1), set()),
    ("qwen", layout(2, 2, 2), set()),
])
def test_upstreams_own_models(model, parallel, groups):
    if not (UPSTREAM / model / "models").is_dir():
        pytest.skip(f"no models/{model} in the upstream snapshot")
    found = problems(CodeFacts.of(UPSTREAM / model), parallel)
    assert {line.split("'")[1] for line in found} == groups, found
