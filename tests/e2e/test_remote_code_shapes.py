"""Remote-code models (auto_map) of three shapes, migrated with --trust-remote-code.

Built from tests/support/remote_fixture.py's TinyCustom checkpoint by replacing parts of its modeling code:

- attention: the fixture as it is (its own GQA attention, rotary embeddings and mask builder);
- moe: every MLP is a mixture of experts with its own top-k router (softmax, top 2 of 4,
  renormalised), experts in a ModuleList;
- cache: the model builds its own Cache class (a DynamicCache subclass in a separate local module,
  counting the tokens it holds itself) instead of taking transformers' default.

Each is migrated by `migrator run --trust-remote-code` and must match the remote code itself
(AutoModelForCausalLM with trust_remote_code) in the recipe's parity check.
"""

from __future__ import annotations

import json

import pytest

import remote_fixture
from migrator_cli import run_cli

MOE_SRC = '''

class TinyCustomRouter(nn.Module):
    """Top-k softmax router: weights renormalised over the chosen experts."""

    def __init__(self, config, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)

    def forward(self, x):
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts


class TinyCustomMoE(nn.Module):
    def __init__(self, config, num_experts=4):
        super().__init__()
        self.router = TinyCustomRouter(config, num_experts)
        self.experts = nn.ModuleList([TinyCustomMLP(config) for _ in range(num_experts)])

    def forward(self, x):
        weights, chosen = self.router(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            weight = (weights * (chosen == index)).sum(-1, keepdim=True)
            out = out + weight * expert(x)
        return out

'''

CACHE_MODULE = '''\
"""TinyCustom's own KV cache (remote code)."""

from transformers.cache_utils import DynamicCache


class TinyCustomCache(DynamicCache):
    """A DynamicCache that counts the tokens it holds itself (what the model asks for positions)."""

    def __init__(self, config=None):
        super().__init__(config=config)
        self.tokens_seen = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.tokens_seen += key_states.shape[-2]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx=0):
        return self.tokens_seen
'''


def _variant(shape: str) -> dict[str, str]:
    files = dict(remote_fixture.MODULE_FILES)
    modeling = files["modeling_tinycustom.py"]
    if shape == "moe":
        anchor = "\n\nclass TinyCustomAttention(nn.Module):"
        assert anchor in modeling and "self.mlp = TinyCustomMLP(config)" in modeling
        modeling = modeling.replace(anchor, MOE_SRC + anchor.lstrip("\n"), 1)
        modeling = modeling.replace("self.mlp = TinyCustomMLP(config)", "self.mlp = TinyCustomMoE(config)")
    elif shape == "cache":
        old = "            past_key_values = DynamicCache(config=self.config)"
        assert old in modeling
        modeling = modeling.replace(old, "            past_key_values = TinyCustomCache(config=self.config)")
        # transformers' generate() hands in an empty DynamicCache: the model swaps in its own.
        modeling = modeling.replace(
            "        if use_cache and past_key_values is None:",
            "        if use_cache and past_key_values is not None and not isinstance(past_key_values, TinyCustomCache) \\\n"
            "                and past_key_values.get_seq_length() == 0:\n"
            "            past_key_values = None\n"
            "        if use_cache and past_key_values is None:")
        modeling = modeling.replace("from .tinycustom_layers import",
                                    "from .tinycustom_cache import TinyCustomCache\nfrom .tinycustom_layers import")
        files["tinycustom_cache.py"] = CACHE_MODULE
    files["modeling_tinycustom.py"] = modeling
    return files


@pytest.fixture(scope="module")
def remote_variants(tmp_path_factory):
    """shape -> a tiny remote-code checkpoint of that shape."""
    built = {}

    def get(shape: str):
        if shape not in built:
            saved = remote_fixture.MODULE_FILES
            remote_fixture.MODULE_FILES = _variant(shape)
            try:
                built[shape] = remote_fixture.build_remote_code_checkpoint(
                    tmp_path_factory.mktemp(f"remote_{shape}") / f"tiny_{shape}")
            finally:
                remote_fixture.MODULE_FILES = saved
        return built[shape]

    return get


def test_variants_are_what_they_say(remote_variants):
    """The checkpoints load through auto_map with their own router / cache classes."""
    import torch
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_pretrained(remote_variants("moe"), trust_remote_code=True)
    assert type(moe.model.layers[0].mlp).__name__ == "TinyCustomMoE"
    assert len(moe.model.layers[0].mlp.experts) == 4
    cached = AutoModelForCausalLM.from_pretrained(remote_variants("cache"), trust_remote_code=True)
    with torch.inference_mode():
        out = cached(torch.tensor([[5, 6, 7]]), use_cache=True)
    assert type(out.past_key_values).__name__ == "TinyCustomCache" and out.past_key_values.tokens_seen == 3


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["attention", "moe", "cache"])
def test_remote_code_shape_migrates_with_parity(shape, remote_variants, tmp_path):
    ckpt = remote_fixture.build_remote_code_checkpoint(tmp_path / "attention") if shape == "attention" \
        else remote_variants(shape)
    proc = run_cli("run", str(ckpt), "--name", "custom", "--output-dir", str(tmp_path / "out"),
                   "--device", "cpu", "--trust-remote-code", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recipe = tmp_path / "out" / "custom"
    parity = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())["verification"]["parity"]
    assert parity["checked"] and parity["max_abs_logits_diff"] <= 1e-4 and parity["greedy_tokens_equal"], parity
    models = recipe / "models"
    if shape == "moe":
        assert "class TinyCustomRouter" in (models / "modeling_custom.py").read_text()
    if shape == "cache":
        assert (models / "tinycustom_cache.py").is_file()
        assert "from models.tinycustom_cache import TinyCustomCache" in (models / "modeling_custom.py").read_text()
