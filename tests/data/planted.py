"""A corpus with planted near-copies, for the near-dedup tests (unit and end to end): distinct random documents, a
few of them copied into another file with a few words edited, and one copied exactly (exact dedup's, not near)."""

from __future__ import annotations

import json
import random
from pathlib import Path

EDITED = 2  # words replaced in each near copy
# With 150-200-word documents and 3-word shingles, a near copy's Jaccard similarity is ~0.93 (6 shingles of ~175 are
# new), where threshold 0.7's bands (14 x 9) find a pair with probability > 0.9999; two documents of random words
# share no shingle.
NGRAM, THRESHOLD = 3, 0.7


def planted_corpus(folder: Path, documents: int = 120, copies: int = 8, seed: int = 7) -> dict:
    """Write `a-originals.jsonl` and `b-copies.jsonl` (text format, field `text`; named so the originals sort first,
    as near dedup keeps the first by source and line); returns what a run must remove:
    {"near": {(copy source, line): (original source, line)}, "exact": [(source, line)]}."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    docs = [[rng.choice(vocab) for _ in range(rng.randint(150, 200))] for _ in range(documents)]
    originals = folder / "a-originals.jsonl"
    originals.write_text("".join(json.dumps({"text": " ".join(d)}) + "\n" for d in docs))
    near, lines = {}, []
    for i, which in enumerate(rng.sample(range(documents), copies)):
        words = list(docs[which])
        for at in rng.sample(range(len(words)), EDITED):
            words[at] = rng.choice(vocab) + "x"  # a word no document has
        lines.append(json.dumps({"text": " ".join(words)}))
        near[(str(folder / "b-copies.jsonl"), i + 1)] = (str(originals), which + 1)
    lines.append(json.dumps({"text": " ".join(docs[0])}))  # an exact copy: exact dedup drops it, not near dedup
    (folder / "b-copies.jsonl").write_text("\n".join(lines) + "\n")
    return {"near": near, "exact": [(str(folder / "b-copies.jsonl"), copies + 1)], "documents": documents}
