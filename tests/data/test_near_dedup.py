"""Near-duplicate removal without Ray (data/near_dedup.py): signatures estimate Jaccard similarity, the LSH bands
follow the threshold, and the three steps (bands, near copies per band partition, drop per shard) remove exactly
the planted near copies, naming their originals (the stage end to end on Ray is in test_prepare.py)."""

import numpy as np
import pytest

from data.near_dedup import (
    NearDupPlan,
    band_keys,
    band_rows,
    first_references,
    lsh_bands,
    minhash,
    near_duplicates,
    shingles,
)
from data.shards import drop_near_copies
from data.sources import discover, read_lines
from tests.data.planted import NGRAM, THRESHOLD, planted_corpus


def jaccard(a: str, b: str, n: int = 5) -> float:
    sa, sb = ({tuple(t.split()[i:i + n]) for i in range(len(t.split()) - n + 1)} for t in (a, b))
    return len(sa & sb) / len(sa | sb)


def test_signatures_estimate_jaccard_similarity():
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in rng.integers(0, 10_000, 200)]
    texts = [" ".join(words)]
    for edits in (2, 10, 40):
        changed = list(words)
        for at in rng.choice(200, edits, replace=False):
            changed[at] = "new"
        texts.append(" ".join(changed))
    texts += ["short text", "", " ".join(words).upper()]  # fewer words than a shingle; nothing; case differs
    hashes, starts = shingles(texts, 5)
    sig = minhash(hashes, starts, 256)
    for i in (1, 2, 3):
        assert abs((sig[0] == sig[i]).mean() - jaccard(texts[0], texts[i])) < 0.1, i
    assert (sig[0] == sig[6]).all()  # compared lower-cased
    assert (sig[4] != sig[0]).all() and (sig[4] == minhash(*shingles(["short text"], 5), 256)[0]).all()
    # The same text gives the same signature wherever it sits in a batch.
    assert (minhash(*shingles(texts[2:3], 5), 256)[0] == sig[2]).all()


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.8, 0.9])
def test_bands_put_the_s_curve_at_the_threshold(threshold):
    bands, rows = lsh_bands(threshold, 128)
    assert bands * rows <= 128

    def p(s):
        return 1 - (1 - s**rows) ** bands

    assert p(threshold - 0.2) < 0.2 and p(threshold + 0.1) > 0.85 and p(threshold - 0.05) < p(threshold) < p(threshold + 0.05)


def test_planted_near_copies_are_removed_exactly_naming_their_originals(tmp_path):
    planted = planted_corpus(tmp_path)
    from data.examples import ExamplePlan, to_examples
    from data.records import RecordRules
    from data.template import ChatRenderer, TemplateSpec

    plan = NearDupPlan(NGRAM, 128, *lsh_bands(THRESHOLD, 128), partitions=3)
    renderer = ChatRenderer.build(TemplateSpec(None, {}, "", False))
    example_plan = ExamplePlan(RecordRules(format="text"), renderer, 0, 0.0, 128, num_shards=2, near=plan)
    examples = [to_examples(b, example_plan) for f in discover([str(tmp_path)], "auto", 0, "inputs")
                for b in read_lines(f, 50)]
    bands = [band_rows(e) for e in examples]
    assert sum(b.num_rows for b in bands) == sum(e.num_rows for e in examples) * plan.bands
    import pyarrow as pa

    every = pa.concat_tables(bands)
    partition = every["band"].to_numpy() % np.uint64(plan.partitions)
    found: dict[int, list] = {}
    for part in range(plan.partitions):  # as the band tasks do, each on its partition alone
        for shard, table in near_duplicates(every.filter(pa.array(partition == part)), 2).items():
            found.setdefault(shard, []).append(table)
    removed = {}
    for shard, tables in found.items():
        refs = first_references(pa.concat_tables(tables))
        group = pa.concat_tables(examples).filter(pa.array(pa.concat_tables(examples)["part"].to_numpy() == shard))
        kept, lines = drop_near_copies(group.drop_columns(["bands"]), refs)
        assert kept.num_rows + len(lines) == group.num_rows
        removed.update({(r["source"], r["line"]): (r["near_copy_of"]["source"], r["near_copy_of"]["line"])
                        for r in lines})
        assert all(r["reason"] == "near_duplicate" and r["detail"].startswith("near copy of ") for r in lines)
    # Exactly the planted near copies (the exact copy shares its original's key0: not a near copy of it).
    assert removed == planted["near"]
    assert band_keys(["a b c d e f"], plan).shape == (1, plan.bands)
