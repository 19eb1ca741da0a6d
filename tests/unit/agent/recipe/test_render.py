"""Values from the user reach generated files only escaped for that file's language (SPEC §6).

Property tests (hypothesis, bounded): config.json string/number fields and the model path/source
filled with arbitrary values. The pre-flight (checkpoint checks, source location, routing) either
refuses with a MigratorError or the rendered recipe parses (Python compiles, YAML loads to the same
values, `bash -n` passes) and no code from the values runs. One end-to-end run migrates a checkpoint
whose path is built to break out of every file format.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.errors import MigratorError
from agent.paths import demo_model_dir
from migrator_cli import run_cli

MARKER = "PWNED"
PAYLOADS = ['"""; import os; os.system("touch PWNED"); """', "'; touch PWNED; '", "$(touch PWNED)",
            "`touch PWNED`", "\n!!python/object/apply:os.system ['touch PWNED']", "{{ 7*7 }}{% raw %}",
            "a: b\nc: [", "\\x00\\", "\u2028", "#"]

json_scalars = st.one_of(
    st.text(max_size=40), st.sampled_from(PAYLOADS), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none())
json_values = st.one_of(json_scalars, st.lists(json_scalars, max_size=3),
                        st.dictionaries(st.text(max_size=8), json_scalars, max_size=3))


def _render_from(ckpt: Path, recipe: Path, model_source: str) -> list[Path]:
    """What node_acquire/node_vendor/node_render do before a run, minus copying source code."""
    from agent.migrate.checkpoint_check import check_checkpoint
    from agent.recipe.render import render_recipe
    from agent.recipe.routing import route
    from agent.recipe.spec import VENDORED_KEYS, RecipeSpec
    from agent.migrate.vendor import locate_source

    config = check_checkpoint(ckpt)
    source = locate_source(config, ckpt)
    spec = RecipeSpec.for_checkpoint(
        model_name="fuzz", model_dir=ckpt, model_source=model_source, architecture=source.architecture,
        family=route(config.get("text_config") or config).name, config=config, device="cpu", max_new_tokens=8,
        vendored={"codemods": {}, **{k: getattr(source, k) for k in VENDORED_KEYS}})
    return render_recipe(recipe, spec.context(), spec.family_spec())


def _assert_parses(files: list[Path], model_path: str, model_source: str) -> None:
    for path in files:
        text = path.read_text()
        if path.suffix == ".py":
            compile(text, str(path), "exec")
        elif path.suffix == ".yaml":
            settings_ = yaml.safe_load(text)
            assert settings_["model_path"] == model_path and settings_["model_source"] == model_source
        elif path.suffix == ".sh":
            assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    shutil.copytree(demo_model_dir(), root / "base")
    return root


FIELDS = ["architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "vocab_size", "intermediate_size", "head_dim",
          "rms_norm_eps", "dtype", "torch_dtype", "eos_token_id", "pad_token_id", "tie_word_embeddings",
          "sliding_window", "rope_parameters", "auto_map", "quantization_config", "hidden_act", "text_config"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), json_values, min_size=1, max_size=3))
def test_config_fields_never_crash_or_inject(workdir, changes):
    ckpt = workdir / "ckpt"
    recipe = workdir / "recipe"
    for path in (ckpt, recipe):
        shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(workdir / "base", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        files = _render_from(ckpt, recipe, str(ckpt))
    except MigratorError:
        return     # refused with a one-line error: fine
    finally:
        os.chdir(cwd)
    _assert_parses(files, str(ckpt.resolve()), str(ckpt))
    assert not (workdir / MARKER).exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=st.one_of(st.text(max_size=60), st.sampled_from(PAYLOADS)),
       path_text=st.one_of(st.text(max_size=60), st.sampled_from(PAYLOADS)))
@example(source="\x80", path_text="")   # found by hypothesis: a C1 control character broke the YAML comment
def test_paths_and_sources_are_escaped(workdir, source, path_text):
    """model_path and model_source carry any text into the YAML, the README and the comments."""
    from agent.recipe.render import render_recipe
    from agent.recipe.spec import RecipeSpec

    recipe = workdir / "recipe_text"
    shutil.rmtree(recipe, ignore_errors=True)
    spec = RecipeSpec(model_name="fuzz", model_path=path_text, model_source=source, architecture="LlamaForCausalLM",
                      family="standard", device="cpu", dtype="float32", input_max_len=16, max_new_tokens=8,
                      transformers_version="5", modeling_codemods=(source,), model_class="LlamaForCausalLM",
                      config_class="LlamaConfig", modeling_module=source, configuration_module=source,
                      origin=source, attn_implementation="sdpa")
    files = render_recipe(recipe, spec.context(), spec.family_spec())
    _assert_parses(files, path_text, source)
    readme = (recipe / "README.md").read_text()
    assert "\n```" not in readme.split("## Run")[0]   # no code block opened by the user's text


@pytest.mark.parametrize("name", ["Model", "Model_Config", "fuzz_runner"])
def test_identifiers_pass_and_non_identifiers_are_refused(tmp_path, name):
    import dataclasses

    from agent.errors import VendorError
    from agent.recipe.render import render_recipe
    from agent.recipe.spec import RecipeSpec

    spec = RecipeSpec(model_name="fuzz", model_path="/m", model_source="/m", architecture="A", family="standard",
                      device="cpu", dtype="float32", input_max_len=16, max_new_tokens=8, transformers_version="5",
                      model_class=name, config_class="LlamaConfig", modeling_module="m", configuration_module="m",
                      origin="o", attn_implementation="sdpa")
    render_recipe(tmp_path / "ok", spec.context(), spec.family_spec())
    bad = dataclasses.replace(spec, model_class=name + "(); import os")
    with pytest.raises(VendorError):
        render_recipe(tmp_path / "bad", bad.context(), bad.family_spec())
    assert not (tmp_path / "bad").exists()


def test_hostile_checkpoint_path_migrates_and_runs_nothing(tmp_path):
    """End to end: a checkpoint folder whose name tries to break out of Python, YAML, shell and
    Markdown is migrated, its recipe runs and nothing from the name is executed."""
    hostile = 'ck"""pt$(touch PWNED)`touch PWNED`\'; touch PWNED #: [x'
    ckpt = tmp_path / hostile
    shutil.copytree(demo_model_dir(), ckpt)
    tmp_root = tmp_path / "tmp"
    tmp_root.mkdir()
    proc = run_cli("run", str(ckpt), "--name", "hostile", "--output-dir", str(tmp_path / "out"),
                   "--device", "cpu", "--max-new-tokens", "4", cwd=tmp_path, env={"TMPDIR": str(tmp_root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The parity check's temporary folders are removed (torch's own compile cache may stay).
    assert [p.name for p in tmp_root.iterdir() if not p.name.startswith("torchinductor_")] == []
    settings_ = yaml.safe_load((tmp_path / "out" / "hostile" / "config" / "hostile_1card_eager.yaml").read_text())
    assert settings_["model_path"] == str(ckpt)
    assert not list(tmp_path.rglob(MARKER)) and not Path(MARKER).exists()
