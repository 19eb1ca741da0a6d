"""Expert parallel and attention data parallel of a native MoE recipe, end to end: a tiny glm4_moe (a MoE family
no other test names; 4 routed experts, a shared expert, its first layer dense by first_k_dense_replace) migrated
natively into a copy of the cann-recipes-infer snapshot, run by upstream's launcher under the stand-in through
`migrator run RECIPE --standin --yaml Y --world-size N` on a batch of two prompts of unequal length, each step
held to transformers by the precision check with the expert-parallel reduction order as a reference
(agent.measure.precision: split_expert_parallel), the MC2 dispatch / combine kernels in the usage record.

The default suite runs EP 2 (attn_tp_size 2, moe_tp_size 1) at 2 ranks; TP 2 x EP 2 at 4 ranks, attention DP + EP
at 2 ranks and a wrong routing (each EP rank holding the next rank's experts) are `slow`. The block itself at
every layout, with the same fault, in-process: tests/unit/agent/recipe/native/test_moe_features.py
(test_expert_parallel_and_attention_data_parallel_at_two_ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.measure import reference as upstream
from framework_recipes import INSTALLED, MAX_NEW_TOKENS, PROMPTS
from migrator_cli import run_cli
from upstream_checkout import copy_checkout

MODEL_TYPE = "glm4_moe"
MC2 = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
# the generated block's EP layout: rank r holds experts [r * L, (r + 1) * L)
FIRST_EXPERT = "self.first_expert = self.ep_rank * self.local_experts"


@pytest.fixture(scope="module")
def ep_recipe(tmp_path_factory):
    from agent.workflow.run import run_migration

    root = tmp_path_factory.mktemp("expert_parallel")
    checkout = copy_checkout(root)
    checkpoint = upstream.tiny_checkpoint(MODEL_TYPE, root / "ckpt")
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "tiny_ep",
                   "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", **INSTALLED}, stop_after="render")
    recipe = checkout / "models" / "tiny_ep"
    assert not (recipe / "models" / "modeling_tiny_ep_framework.py").exists()       # native, not the adapter
    prompts = root / "prompts"
    prompts.mkdir()
    (prompts / "default_prompt.json").write_text(json.dumps({"text": PROMPTS}))
    return {"recipe": recipe, "checkpoint": checkpoint, "prompts": prompts,
            "config": json.loads((checkpoint / "config.json").read_text())}


def run_layout(ep_recipe, name: str, world: int, attn: int, moe: int, lmhead: int, embed: int = 1,
               exe_mode: str | None = None):
    """The recipe's YAML at this layout on the two prompts (batch 2), run per step: (proc, summary, baseline)."""
    recipe = ep_recipe["recipe"]
    data = yaml.safe_load((recipe / "config" / "tiny_ep.yaml").read_text())
    data["model_config"]["model_path"] = str(ep_recipe["checkpoint"])
    if exe_mode:
        data["model_config"]["exe_mode"] = exe_mode
    data["data_config"]["dataset_path"] = str(ep_recipe["prompts"])
    data["scheduler_config"]["batch_size"] = 2
    data["parallel_config"].update(world_size=world, attn_tp_size=attn, moe_tp_size=moe, embed_tp_size=embed,
                                   lmhead_tp_size=lmhead)
    (recipe / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    proc = run_cli("run", str(recipe), "--standin", "--yaml", name, "--world-size", str(world), "--max-rounds", "0",
                   "--json", timeout=1800)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1]) if "{" in proc.stdout else {}
    baseline = json.loads(Path(summary["baseline_path"]).read_text()) if summary.get("baseline_path") else {}
    return proc, summary, baseline


def check_expert_parallel(proc, summary, baseline, world: int, ep: int):
    assert proc.returncode == 0 and summary.get("status") == "ok", (proc.stdout + proc.stderr)[-3000:]
    standin = baseline["standin"]
    assert standin["world_size"] == world and standin["unsupported"] == [], standin
    kernels = standin["reference_kernels"]
    # the decode's tokens moved by MC2, the prefill's by all-to-all double routing, the grouped matmul local
    assert kernels.get(MC2[0], 0) == kernels.get(MC2[1], 0) > 0, kernels
    assert kernels.get("npu_moe_re_routing", 0) > 0 and kernels.get("npu_grouped_matmul", 0) > 0, kernels
    parity = baseline["verification"]["parity"]
    assert parity["checked"] and parity["ok"] and parity["ranks"] == world, parity
    assert parity["expert_parallel_split"]["parts"] == ep and parity["expert_parallel_split"]["count"] >= 1, parity
    assert "expert-parallel partial sums" in parity["reference_dtypes"][-1], parity
    assert parity["decode_steps_checked"] > 0
    lengths = {r["prompt_tokens"] for r in parity["per_request"]}
    assert len(lengths) == 2, parity["per_request"]                           # prompts of unequal length
    return kernels


def test_expert_parallel_two_ranks_runs_mc2_and_passes_each_step(ep_recipe):
    """EP 2 (moe_tp_size 1: moe_ep_size = 2 // 1) under attention TP 2: each rank holds 2 of the 4 experts; the
    shared expert and the dense first layer whole on every rank (upstream's qwen3_moe / deepseek_r1 placing)."""
    proc, summary, baseline = run_layout(ep_recipe, "ep2.yaml", 2, 2, 1, 2)
    kernels = check_expert_parallel(proc, summary, baseline, world=2, ep=2)
    print(f"EP 2 at 2 ranks: {', '.join(f'{k} {kernels[k]}' for k in (*MC2, 'npu_moe_re_routing'))}")


@pytest.mark.slow
def test_tensor_by_expert_parallel_four_ranks(ep_recipe):
    """TP 2 x EP 2 at 4 ranks (attn_tp_size 4, moe_tp_size 2): experts' widths over moe_tp_group (consecutive ranks),
    experts over moe_ep_group (stride 2). Default-suite case of this path: test_expert_parallel_two_ranks_runs_mc2_and_passes_each_step."""
    proc, summary, baseline = run_layout(ep_recipe, "tp2ep2.yaml", 4, 4, 2, 4)
    check_expert_parallel(proc, summary, baseline, world=4, ep=2)


@pytest.mark.slow
def test_attention_data_parallel_with_expert_parallel_two_ranks(ep_recipe):
    """attn_tp_size 1 at 2 ranks: each rank attends to its own request (upstream's batch_size // attn_dp_size), the
    experts over EP 2 route both ranks' tokens, the embedding and the lm head split by vocabulary over both ranks
    (embed_tp_size / lmhead_tp_size 2, as upstream's deepseek_r1 splits them: each gathers the other request's rows
    first); each rank's request passes every step, its decode compiled by npugraph_ex (the YAML as written): the
    last decode step of the 109-token prompt is 0.80 of its tolerance with the compiled-step rounding
    (agent.measure.precision: compiled_step_allowance), 1.0077 without it, 0.9431 eager."""
    proc, summary, baseline = run_layout(ep_recipe, "dp2ep2.yaml", 2, 1, 1, 2, embed=2)
    check_expert_parallel(proc, summary, baseline, world=2, ep=2)
    assert sorted(r["rank"] for r in baseline["verification"]["parity"]["per_request"]) == [0, 1]


@pytest.mark.slow
def test_attention_data_parallel_where_one_group_ends_at_eos_first(ep_recipe, tmp_path):
    """attn_tp_size 1 at 2 ranks with the checkpoint's EOS set to the token rank 0's request writes early (and rank
    1's never): upstream's offline scheduler runs every rank max_new_tokens decode steps all the same, the output cut
    at the EOS (scheduler._should_finish), so rank 1's MoE and lm-head collectives keep their partner; the run ends,
    rank 0's request ends at its EOS and rank 1's runs on, both passing every step. Default-suite case of the
    record's side: tests/unit/agent/measure/test_precision.py
    (test_a_data_parallel_ranks_one_request_ended_at_eos_decodes_on_without_steps)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tmp_path / "ckpt_eos"
    shutil.copytree(ep_recipe["checkpoint"], checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def greedy(prompt):
        # the executor's prompt: the chat template over one user message (upstream's default dataset)
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            for _ in range(MAX_NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        return ids[0, -MAX_NEW_TOKENS:].tolist()

    first, second = (greedy(prompt) for prompt in PROMPTS)
    step = next(k for k in range(1, MAX_NEW_TOKENS - 2) if first[k] not in first[:k] and first[k] not in second)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((checkpoint / name).read_text())
        data["eos_token_id"] = first[step]
        (checkpoint / name).write_text(json.dumps(data))
    proc, summary, baseline = run_layout({**ep_recipe, "checkpoint": checkpoint}, "dp2ep2_eos.yaml", 2, 1, 1, 2,
                                         embed=2)
    check_expert_parallel(proc, summary, baseline, world=2, ep=2)
    tokens = {r["rank"]: r["tokens"] for r in baseline["verification"]["parity"]["per_request"]}
    assert tokens[0] == step + 1 and tokens[1] >= MAX_NEW_TOKENS, tokens


@pytest.mark.slow
def test_an_experts_tokens_sent_to_another_ranks_expert_fail_the_check(ep_recipe):
    """Each EP rank loading the next rank's experts (the router's choice computed by another expert): the
    per-step check fails at the prefill, naming the step."""
    modeling = ep_recipe["recipe"] / "models" / "modeling_tiny_ep.py"
    correct = modeling.read_text()
    assert correct.count(FIRST_EXPERT) == 1
    modeling.write_text(correct.replace(FIRST_EXPERT, "self.first_expert = (self.ep_rank + 1) % self.ep_size * "
                                                      "self.local_experts"))
    try:
        proc, summary, baseline = run_layout(ep_recipe, "ep2_misrouted.yaml", 2, 2, 1, 2)
    finally:
        modeling.write_text(correct)
    parity = baseline["verification"]["parity"]
    assert proc.returncode == 1 and parity["ok"] is False, (proc.stdout + proc.stderr)[-3000:]
    assert parity["first_failing_step"] == "the prefill", parity


def test_more_ranks_and_the_oom_path_lay_the_experts_out_expert_parallel(ep_recipe):
    """`migrator run RECIPE --standin --world-size 4` of the single-card recipe (the run plan) and the OOM path (a card that holds a quarter of
    the model: the 4-card YAML it writes) give upstream's MoE layout: attention and lm head tensor parallel, the
    experts expert parallel (moe_tp_size 1: 1 of the 4 experts a rank), named in the plan's notes and the OOM
    message; the per-rank estimate counts rank 0's expert alone."""
    from agent.measure.memory import estimate, out_of_memory
    from agent.recipe.recipe import Recipe
    from agent.run.plan import plan_run

    recipe = Recipe.at(ep_recipe["recipe"])
    expected = {"world_size": 4, "attn_tp_size": 4, "moe_tp_size": 1, "embed_tp_size": 1, "lmhead_tp_size": 4}
    how = ("attention tensor parallel over 4, experts expert parallel over 4 (moe_tp_size 1, moe_ep_size 4: 1 of 4 "
           "routed experts a rank)")
    plan = plan_run(recipe, 4, weights=ep_recipe["checkpoint"], standin="cpu")      # the 1-card YAML scaled to 4
    assert plan.parallel == expected and f"4 ranks: {how}" in plan.notes, plan
    assert yaml.safe_load(plan.yaml.read_text())["parallel_config"] == expected
    # the OOM path, on the recipe's YAML pointed at the weights (as on the NPU host)
    own, readme = recipe.yaml.read_text(), (recipe.path / "README.md").read_text()
    written = []
    try:
        recipe.yaml.write_text(own.replace('"your_model_path"', json.dumps(str(ep_recipe["checkpoint"]))))
        config = ep_recipe["config"]
        sizes = estimate(ep_recipe["checkpoint"], config, "bfloat16", 1, 64, None, "npu", expert_parallel=True)
        assert sizes["per_rank"][4]["local_experts"] == 1 and sizes["per_rank"][4]["layout"] == expected
        card = sizes["per_rank"][4]["needed_bytes"]
        memory = estimate(ep_recipe["checkpoint"], config, "bfloat16", 1, 64, card, "npu", expert_parallel=True)
        assert memory["cards_needed"] == 4, memory["per_rank"]
        message = out_of_memory(recipe, memory)
        written.append(recipe.path / memory["multicard_yaml"])
        assert f"4 cards fit ({how}, " in message, message
        assert yaml.safe_load(written[0].read_text())["parallel_config"] == expected
    finally:
        recipe.yaml.write_text(own)
        (recipe.path / "README.md").write_text(readme)
        for path in written:
            path.unlink()
