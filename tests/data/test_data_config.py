"""The data stage's Config: the sample YAML loads, bad fields are named, the version ignores where output goes.

(Named test_data_config.py: tests/core/test_config.py already holds the basename.)
"""

from pathlib import Path

import pytest

from data.config import Config, content_config_hash
from core.config import ConfigError, from_dict, load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]


def test_sample_yaml_mirrors_the_dataclass():
    cfg = load_config(Config, ROOT / "configs" / "data" / "sample.yaml")
    assert cfg.format == "chat" and cfg.seq_len == 128 and cfg.packing == "pack"
    assert cfg.eval_inputs == ["out/corpus/eval.jsonl"] and cfg.mlflow_experiment == "rayline-data"
    # Every field is spelled out in the YAML, so it documents the whole config.
    text = (ROOT / "configs" / "data" / "sample.yaml").read_text()
    missing = [f for f in Config.__dataclass_fields__ if f"\n{f}:" not in "\n" + text]
    assert missing == []


@pytest.mark.parametrize("override, field", [
    ("seq_len=4", "seq_len"), ("eval_fraction=1.0", "eval_fraction"), ("packing=stuff", "packing"),
    ("format=csv", "format"), ("num_shards=-1", "num_shards"), ("shard_bytes=1000", "shard_bytes"), ("min_chars=10", "min_chars"), ("inputs=[]", "inputs"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(Config, ROOT / "configs" / "data" / "sample.yaml", [override, "max_chars=5"] if field == "min_chars"
                    else [override])


def test_version_hash_ignores_where_and_how_not_what():
    base = {"inputs": ["a.jsonl"], "output_uri": "out/x", "tokenizer": "tok"}
    a = content_config_hash(from_dict(Config, base))
    assert a == content_config_hash(from_dict(Config, {**base, "output_uri": "s3://b/y", "overwrite": True}))
    assert a != content_config_hash(from_dict(Config, {**base, "seq_len": 1024}))
    assert a != content_config_hash(from_dict(Config, {**base, "seed": 1}))


def test_shards_by_input_size_depend_on_the_input_only():
    from data.config import shard_count

    auto = from_dict(Config, {"inputs": ["a.jsonl"], "output_uri": "o", "tokenizer": "t", "shard_bytes": 1 << 20})
    assert auto.num_shards == 0  # the default: by input size
    assert [shard_count(auto, n) for n in (0, 1, 1 << 20, (1 << 20) + 1, 10 << 20)] == [1, 1, 1, 2, 10]
    assert shard_count(from_dict(Config, {**to_dict(auto), "num_shards": 3}), 10 << 20) == 3
