"""agent/migrate/quantization.py: published quantized checkpoints recognised from their config, every tensor
accounted for (an unknown one refused naming it), and each format's route; the input step's answers for them
(check_checkpoint: accepted — served or converted —, refused with the true line); auto_map classes transformers implements served by
transformers (the repo's code never imported without --trust-remote-code); a tokenizer that is the repo's own
code loads only with that consent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantized_checkpoints as forms
from agent.errors import InputError, UnsupportedModelError
from agent.migrate import quantization
from agent.migrate.checkpoint_check import check_checkpoint
from agent.migrate.vendor import locate_source

BUILDERS = {"deepseek_v3_fp8": forms.deepseek_v3_fp8, "qwen3_fp8": forms.qwen3_fp8,
            "gpt_oss_mxfp4": forms.gpt_oss_mxfp4, "qwen3_w8a8": forms.qwen3_w8a8, "llama_awq": forms.llama_awq}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("forms")
    return {name: build(root / name)[0] for name, build in BUILDERS.items()}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# form -> (route, label fragment, quantized outputs, dropped)
EXPECTED = {
    "deepseek_v3_fp8": ("convert", "block-FP8 (quant_method fp8, weight_block_size 128x128)", 49, 0),
    "qwen3_fp8": ("convert", "block-FP8 (quant_method fp8, weight_block_size 128x128)", 14, 0),
    "gpt_oss_mxfp4": ("convert", "MXFP4 (quant_method mxfp4)", 4, 0),
    "qwen3_w8a8": ("native", "compressed-tensors (int8 W8A8 dynamic per token, format int-quantized)", 14, 0),
    "llama_awq": ("convert", "AWQ (quant_method awq, int4 weights, group size 32)", 14, 0),
}


@pytest.mark.parametrize("form", list(EXPECTED))
def test_each_published_form_is_recognised_and_every_tensor_accounted_for(built, form):
    path = built[form]
    scheme = quantization.scheme_of(_config(path), path)
    route, label, outputs, dropped = EXPECTED[form]
    assert (scheme.route, scheme.label) == (route, label), scheme
    tensors = quantization.read_tensors(path)
    accounting = quantization.account(scheme, tensors)
    parts = {name for q in accounting.quantized for name in q.parts.values()}
    assert (len(accounting.quantized), len(accounting.dropped)) == (outputs, dropped)
    # every tensor exactly once: a quantized part, kept, or dropped
    assert parts | set(accounting.kept) | set(accounting.dropped) == set(tensors)
    assert not parts & set(accounting.kept)
    assert all(tensors[name].dtype in quantization.FLOAT_DTYPES for name in accounting.kept)


def test_deepseek_mtp_layer_and_float_tensors_are_kept_or_converted(built):
    path = built["deepseek_v3_fp8"]
    accounting = quantization.account(quantization.scheme_of(_config(path), path), quantization.read_tensors(path))
    outputs = {q.output: q for q in accounting.quantized}
    mtp = 2   # num_hidden_layers: the MTP layer's index
    assert f"model.layers.{mtp}.eh_proj.weight" in outputs and f"model.layers.{mtp}.mlp.experts.3.down_proj.weight" in outputs
    assert {f"model.layers.{mtp}.shared_head.head.weight", f"model.layers.{mtp}.embed_tokens.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias", "lm_head.weight"} <= set(accounting.kept)
    # a partial block (192 rows = 1.5 blocks of 128) has a scale grid of ceil-divided blocks
    q_a = outputs["model.layers.0.self_attn.q_a_proj.weight"]
    assert q_a.shape == [192, 256] and q_a.params["block"] == [128, 128]


def _with_tensor(src: Path, dest: Path, name: str, value: torch.Tensor | None, drop: str | None = None) -> Path:
    """A copy of the checkpoint `src` with `name` added (or replaced), `drop` removed."""
    import shutil

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    if value is not None:
        tensors[name] = value
    if drop:
        tensors.pop(drop)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


# form, tensor added (name, value), tensor removed, what the line names
FAULTS = [
    ("deepseek_v3_fp8", ("model.layers.0.self_attn.o_proj.weight_zero_point", torch.zeros(2, dtype=torch.int8)), None,
     "model.layers.0.self_attn.o_proj.weight_zero_point"),
    ("deepseek_v3_fp8", ("model.layers.0.mlp.extra.weight_scale_inv", torch.ones(1, 1)), None,
     "model.layers.0.mlp.extra.weight_scale_inv"),
    ("deepseek_v3_fp8", None, "model.layers.0.self_attn.o_proj.weight_scale_inv", "model.layers.0.self_attn.o_proj.weight"),
    ("deepseek_v3_fp8", ("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(1, 1)), None,
     "model.layers.0.self_attn.o_proj.weight_scale_inv is [1, 1]"),
    ("gpt_oss_mxfp4", ("model.layers.0.mlp.experts.extra_scales", torch.zeros(4, 8, dtype=torch.uint8)), None,
     "model.layers.0.mlp.experts.extra_scales"),
    ("gpt_oss_mxfp4", None, "model.layers.0.mlp.experts.down_proj_scales", "model.layers.0.mlp.experts.down_proj_blocks"),
    ("qwen3_w8a8", ("model.layers.0.mlp.extra.weight", torch.zeros(4, 4, dtype=torch.int8)), None,
     "model.layers.0.mlp.extra.weight"),
    ("llama_awq", None, "model.layers.1.mlp.up_proj.qzeros", "model.layers.1.mlp.up_proj.qweight"),
    ("llama_awq", ("model.layers.0.self_attn.q_proj.g_idx", torch.zeros(64, dtype=torch.int32)), None,
     "model.layers.0.self_attn.q_proj.g_idx"),
]


@pytest.mark.parametrize("form,added,removed,named", FAULTS, ids=[f"{f[0]}-{f[3][-30:]}" for f in FAULTS])
def test_a_tensor_outside_the_layout_is_refused_naming_it(built, tmp_path, form, added, removed, named):
    name, value = added or (None, None)
    path = _with_tensor(built[form], tmp_path / "ckpt", name, value, removed)
    with pytest.raises(InputError) as info:
        quantization.account(quantization.scheme_of(_config(path), path), quantization.read_tensors(path))
    assert named in str(info.value) and "re-download" in str(info.value)
    assert info.value.exit_code == 2


def test_the_input_step_accepts_what_is_served_or_converted_and_refuses_the_rest_in_one_line(built, tmp_path):
    for form in ("deepseek_v3_fp8", "qwen3_fp8", "gpt_oss_mxfp4", "llama_awq", "qwen3_w8a8"):
        assert check_checkpoint(built[form])["quantization_config"]
    # a method the migrator does not read: named, exit 3, one line
    import shutil

    other = tmp_path / "hqq"
    shutil.copytree(built["qwen3_fp8"], other)
    config = _config(other)
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        check_checkpoint(other)
    line = str(info.value)
    assert line.startswith("Qwen3ForCausalLM: weights are quantized: quant_method hqq, which the migrator neither "
                           "serves nor converts (not a format the migrator reads or converts") and "\n" not in line
    assert info.value.exit_code == 3
    # a config that says fp8 over weights that are not: the config does not match them
    plain = tmp_path / "plain"
    shutil.copytree(built["qwen3_fp8"], plain)
    tensors = {k: v for k, v in load_file(plain / "model.safetensors").items() if not k.endswith("_scale_inv")}
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(plain / "model.safetensors"))
    with pytest.raises(InputError, match="no tensor is"):
        check_checkpoint(plain)


def test_modelslim_description_is_read_and_every_tensor_must_be_described(built, tmp_path):
    import shutil

    path = tmp_path / "msmodelslim"
    shutil.copytree(built["qwen3_w8a8"], path)
    config = _config(path)
    config.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(config))
    tensors = quantization.read_tensors(path)
    description = {"model_quant_type": "W8A8_DYNAMIC",
                   **{n: ("FLOAT" if info.dtype in quantization.FLOAT_DTYPES else "W8A8_DYNAMIC") for n, info in tensors.items()}}
    (path / quantization.MODELSLIM_DESCRIPTION).write_text(json.dumps(description))
    scheme = quantization.scheme_of(config, path)
    assert (scheme.format, scheme.route) == ("modelslim", "refused")
    with pytest.raises(UnsupportedModelError, match="ModelSlim W8A8_DYNAMIC"):
        check_checkpoint(path)
    description.pop("model.norm.weight")
    (path / quantization.MODELSLIM_DESCRIPTION).write_text(json.dumps(description))
    with pytest.raises(InputError, match="model.norm.weight .*not described"):
        quantization.account(scheme := quantization.scheme_of(config, path), quantization.read_tensors(path))


# ---- auto_map: transformers' own class where it implements the architecture --------------------------------
def test_deepseek_auto_map_is_served_by_transformers_and_its_code_never_runs_without_consent(built):
    path = built["deepseek_v3_fp8"]
    config = _config(path)
    check_checkpoint(path)          # the input step, without --trust-remote-code
    source = locate_source(config, path, trust_remote_code=False)
    assert (source.model_class, source.modeling_module) == (
        "DeepseekV3ForCausalLM", "transformers.models.deepseek_v3.modeling_deepseek_v3")
    assert "served by transformers' own class" in source.note and "--trust-remote-code uses it" in source.note
    assert not (path / forms.REMOTE_CODE_MARKER).exists()
    # with consent, the repo's own code is chosen (read, not run here either)
    remote = locate_source(config, path, trust_remote_code=True)
    assert remote.modeling_file == path / "modeling_deepseek.py" and remote.note is None
    assert not (path / forms.REMOTE_CODE_MARKER).exists()


@pytest.mark.parametrize("model_type,auto_map,native", [
    ("phi3", {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
     True),
    # Kimi-K2: transformers implements DeepseekV3ForCausalLM, but not the config's model_type kimi_k2
    ("kimi_k2", {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}, False),
    # a class of the same name as another type's: not that type's implementation
    ("phi3", {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.LlamaForCausalLM"},
     False),
    ("phi3", {"AutoConfig": "configuration_phi3.MyConfig", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
     False),
    ("phi3", {"AutoConfig": "other--repo--configuration_phi3.Phi3Config",
              "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}, False),
])
def test_auto_map_served_natively_only_for_the_class_transformers_has_for_the_type(model_type, auto_map, native):
    from agent.migrate.vendor import auto_map_served_natively

    config = {"model_type": model_type, "architectures": [auto_map["AutoModelForCausalLM"].rpartition(".")[2]],
              "auto_map": auto_map}
    assert (auto_map_served_natively(config) is not None) is native
    if not native:
        with pytest.raises(UnsupportedModelError, match="--trust-remote-code"):
            locate_source(config, None, trust_remote_code=False)


# ---- a tokenizer that is the repo's own code (Kimi-K2's tiktoken tokenizer) ---------------------------------
KIMI_TOKENIZER = '''import base64, pathlib
pathlib.Path(MARKER).write_text("yes")    # transformers imports a copy in its modules cache: an absolute path
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi-K2's tokenizer class name and files (tiktoken.model: base64 token, rank per line), read without tiktoken."""
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        self.ranks = {}
        for line in pathlib.Path(vocab_file).read_text().splitlines():
            token, rank = line.split()
            self.ranks[base64.b64decode(token).decode("latin-1")] = int(rank)
        self.inverse = {v: k for k, v in self.ranks.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.ranks)

    def get_vocab(self):
        return dict(self.ranks)

    def _tokenize(self, text):
        return list(text.encode("utf-8").decode("latin-1"))

    def _convert_token_to_id(self, token):
        return self.ranks.get(token, 0)

    def _convert_id_to_token(self, index):
        return self.inverse.get(index, "")
'''


def kimi_tokenizer_files(path: Path) -> Path:
    import base64

    for name in ("tokenizer.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    (path / "tokenization_kimi.py").write_text(f"MARKER = {str(path / 'TOKENIZER_CODE_RAN')!r}\n" + KIMI_TOKENIZER)
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "model_max_length": 512}))
    return path


def test_a_repo_code_tokenizer_loads_only_with_trust_remote_code(built, tmp_path):
    import shutil

    path = kimi_tokenizer_files(Path(shutil.copytree(built["deepseek_v3_fp8"], tmp_path / "kimi")))
    with pytest.raises(UnsupportedModelError) as info:
        check_checkpoint(path)
    assert "tokenization_kimi.py: TikTokenTokenizer" in str(info.value) and "--trust-remote-code" in str(info.value)
    assert not (path / "TOKENIZER_CODE_RAN").exists()          # never imported without consent
    check_checkpoint(path, trust_remote_code=True)              # the repo's code, with the user's consent
    assert (path / "TOKENIZER_CODE_RAN").exists()
    # an auto_map that names a file outside the repo: refused by name, nothing imported
    (path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["../evil.Tok", None]}}))
    with pytest.raises(InputError, match="not 'module.ClassName'"):
        check_checkpoint(path, trust_remote_code=True)
