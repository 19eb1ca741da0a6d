"""agent/recipe/upstream_schema.py: a framework YAML checked against the sections and fields upstream's
InferenceConfig reads, read with `ast` from the checkout's own executor. A top-level key of the old flat schema
that one section reads is one evidence line naming where it belongs; a checkout without the executor (or a
YAML that is no mapping) gives nothing."""

from __future__ import annotations

from agent.recipe.upstream_schema import SCHEMA_FILE, check, old_schema_keys, schema

INFERENCE_CONFIG = '''
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    model_path: str = ""
    exe_mode: str = "eager"


@dataclass
class ParallelConfig:
    world_size: int = 1
    attn_tp_size: int = 1


@dataclass
class DataConfig:
    dataset: str = "default"


@dataclass
class InferenceConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: "ParallelConfig" = field(default_factory=ParallelConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    model_name: str = ""
'''


def checkout(root):
    (root / SCHEMA_FILE).parent.mkdir(parents=True)
    (root / SCHEMA_FILE).write_text(INFERENCE_CONFIG)
    return root


def test_the_sections_are_read_from_the_checkouts_own_executor(tmp_path):
    assert schema(checkout(tmp_path)) == {"model_config": {"model_path", "exe_mode"},
                                          "parallel_config": {"world_size", "attn_tp_size"},
                                          "data_config": {"dataset"}}
    assert schema(None) is None and schema(tmp_path / "elsewhere") is None


def test_a_key_of_the_old_schema_names_its_section(tmp_path):
    root = checkout(tmp_path)
    yaml = tmp_path / "models" / "m" / "config" / "m.yaml"
    yaml.parent.mkdir(parents=True)
    yaml.write_text("model_name: m\nmodel_path: /w\nworld_size: 2\nunknown_key: 1\nmodel_config:\n  exe_mode: eager\n")
    assert old_schema_keys({"model_path": 1, "world_size": 2, "model_config": {}, "unknown_key": 0},
                           schema(root)) == [("model_path", "model_config"), ("world_size", "parallel_config")]
    lines = check(yaml, root, shown="config/m.yaml")
    assert lines == [
        "InferenceConfig ignores the top-level key 'model_path' of config/m.yaml (old schema): "
        "executor/core/config/inference_config.py reads it as model_config.model_path",
        "InferenceConfig ignores the top-level key 'world_size' of config/m.yaml (old schema): "
        "executor/core/config/inference_config.py reads it as parallel_config.world_size"]


def test_no_executor_or_no_mapping_gives_no_evidence(tmp_path):
    yaml = tmp_path / "m.yaml"
    yaml.write_text("model_path: /w\n")
    assert check(yaml, tmp_path) == []                          # no executor in this tree
    root = checkout(tmp_path / "co")
    yaml.write_text("- a list\n")
    assert check(yaml, root) == [] and check(tmp_path / "missing.yaml", root) == []
