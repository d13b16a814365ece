"""Weighted mixtures without Ray: counts within one record of each source's share, a small source repeated whole
before any record twice, the same choice on every run (the stage end to end on a mixture is in test_prepare.py)."""

import json
from collections import Counter

import pytest

from data.config import Config, MixtureSource
from data.examples import ExamplePlan, to_examples
from data.mixture import expand, most_without_repeats, plan_mixture, shares
from data.records import RecordRules
from data.sources import discover, read_lines
from data.template import ChatRenderer, TemplateSpec
from core.config import ConfigError, from_dict


@pytest.mark.parametrize("weights, total", [([0.7, 0.2, 0.1], 1000), ([1, 1, 1], 100), ([5, 3, 1, 1], 7), ([1e-3, 1], 50)])
def test_shares_are_within_one_of_the_weights_and_add_up(weights, total):
    counts = shares(weights, total)
    assert sum(counts) == total
    assert all(abs(c - w / sum(weights) * total) < 1 for c, w in zip(counts, weights))


def test_the_default_total_repeats_no_source():
    assert most_without_repeats([700, 50, 1000], [0.7, 0.2, 0.1]) == 250  # the code source (50 at 20%) bounds it
    assert all(c <= n for c, n in zip(shares([0.7, 0.2, 0.1], 250), [700, 50, 1000]))


def write(path, name, n, blank_every=0):
    lines = []
    for i in range(n):
        if blank_every and i % blank_every == 0:
            lines.append("")
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"{name} {i}?"},
                                              {"role": "assistant", "content": f"{name} answer {i}"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def mixture_config(tmp_path, total, seed=0, **weights):
    sizes = {"instructions": 40, "code": 12, "chat": 5}
    sources = []
    for name, w in weights.items():
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        write(d / "a.jsonl", name, sizes[name] // 2, blank_every=3)
        write(d / "b.jsonl", name + "-b", sizes[name] - sizes[name] // 2)
        sources.append({"name": name, "inputs": [str(d)], "weight": w})
    return from_dict(Config, {"inputs": [], "mixture": sources, "mixture_records": total, "seed": seed,
                              "output_uri": str(tmp_path / "out"), "tokenizer": "t"})


def taken(cfg):
    files_of = [discover(m.inputs, "auto", 0, f"mixture[{i}].inputs") for i, m in enumerate(cfg.mixture)]
    plan, rows = plan_mixture(cfg, files_of)
    per_record = Counter()
    for files in files_of:
        for f in files:
            for block in read_lines(f, 7):
                block, _ = expand(block, plan)
                per_record.update(zip(block["source"].to_pylist(), block["line"].to_pylist()))
    return rows, per_record


def test_counts_follow_the_weights_and_a_small_source_repeats_whole_first(tmp_path):
    cfg = mixture_config(tmp_path, 100, instructions=0.5, code=0.3, chat=0.2)
    rows, per_record = taken(cfg)
    assert [(r["name"], r["weight"], r["records"], r["taken"]) for r in rows] == [
        ("instructions", 0.5, 40, 50), ("code", 0.3, 12, 30), ("chat", 0.2, 5, 20)]
    for r in rows:
        mine = {k: v for k, v in per_record.items() if f"/{r['name']}/" in k[0]}
        assert len(mine) == r["records"] and sum(mine.values()) == r["taken"]  # exactly its share, every record once
        base = r["taken"] // r["records"]
        # Whole repeats first: every record base or base + 1 times, exactly `extra` of them once more.
        assert Counter(mine.values()) == +Counter({base: r["records"] - r["extra"], base + 1: r["extra"]})
    assert rows[2]["whole_repeats"] == 4 and rows[2]["extra"] == 0 and rows[1]["extra"] == 6
    again, per_record_again = taken(cfg)
    assert again == rows and per_record_again == per_record  # deterministic
    _, other_seed = taken(mixture_config(tmp_path, 100, seed=1, instructions=0.5, code=0.3, chat=0.2))
    assert other_seed != per_record and sum(other_seed.values()) == 100  # the seed picks the extra records


def test_downsampling_takes_a_seeded_subset_once(tmp_path):
    cfg = mixture_config(tmp_path, 0, instructions=7, code=2, chat=1)  # 0: the most without repeats
    rows, per_record = taken(cfg)
    assert [r["taken"] for r in rows] == [35, 10, 5] and [r["extra"] for r in rows] == [35, 10, 0]
    assert max(per_record.values()) == 1 and sum(per_record.values()) == 50  # chat (5 at 10%) bounds the total


def test_upsampled_copies_survive_exact_dedup_but_stay_one_shard(tiny_model_dir, tmp_path):
    from data.tokens import load_tokenizer, read_tokenizer_files

    tok = load_tokenizer(read_tokenizer_files(str(tiny_model_dir))[1])
    cfg = mixture_config(tmp_path, 20, chat=1.0)
    files_of = [discover(cfg.mixture[0].inputs, "auto", 0, "mixture[0].inputs")]
    plan, _ = plan_mixture(cfg, files_of)
    spec = TemplateSpec(tok.chat_template, dict(tok.special_tokens_map), tok.eos_token)
    example_plan = ExamplePlan(RecordRules(), ChatRenderer.build(spec), 0, 0.0, 128, 4, plan)
    rows = [r for f in files_of[0] for b in read_lines(f, 100) for r in to_examples(b, example_plan).to_pylist()]
    assert len(rows) == 20 and len({(r["key0"], r["key1"]) for r in rows}) == 20  # 4 copies each, distinct keys
    by_record = Counter((r["source"], r["line"]) for r in rows)
    assert set(by_record.values()) == {4}
    for where in by_record:  # a record's copies share key0, so its shard
        assert len({r["key0"] for r in rows if (r["source"], r["line"]) == where}) == 1


def test_bad_mixtures_name_the_field(tmp_path):
    base = {"output_uri": "o", "tokenizer": "t"}
    with pytest.raises(ConfigError, match=r"inputs: give inputs or mixture, not both"):
        from_dict(Config, {**base, "inputs": ["a"], "mixture": [{"name": "x", "inputs": ["b"], "weight": 1}]})
    with pytest.raises(ConfigError, match=r"mixture\[1\].name: 'x': each source needs a name of its own"):
        from_dict(Config, {**base, "inputs": [], "mixture": [{"name": "x", "inputs": ["b"], "weight": 1}] * 2})
    with pytest.raises(ConfigError, match=r"mixture\[0\].weight: 0.0 must be > 0"):
        from_dict(Config, {**base, "inputs": [], "mixture": [{"name": "x", "inputs": ["b"], "weight": 0}]})
    assert MixtureSource("x", ["b"], 1.0) == from_dict(Config, {**base, "inputs": [], "mixture": [
        {"name": "x", "inputs": ["b"], "weight": 1}]}).mixture[0]
    (tmp_path / "empty.jsonl").write_text("\n\n")
    cfg = from_dict(Config, {**base, "inputs": [], "mixture": [{"name": "none", "inputs": [str(tmp_path / "empty.jsonl")],
                                                                "weight": 1}]})
    with pytest.raises(ValueError, match=r"mixture\[0\] \(none\): its inputs hold no records"):
        plan_mixture(cfg, [discover(cfg.mixture[0].inputs, "auto", 0, "mixture[0].inputs")])


def test_a_file_in_two_sources_is_refused(tmp_path):
    from data.prepare import check_distinct

    write(tmp_path / "a.jsonl", "a", 3)
    files = discover([str(tmp_path)], "auto", 0, "mixture[0].inputs") + discover([str(tmp_path / "a.jsonl")], "auto", 0,
                                                                                 "mixture[1].inputs")
    with pytest.raises(ValueError, match=r"a.jsonl is named twice in the inputs"):
        check_distinct(files)
    check_distinct(files[:1])
