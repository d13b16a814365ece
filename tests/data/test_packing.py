"""Packing and padding: every token lands exactly once, labels and boundaries survive, on edge cases too."""

import numpy as np
import pytest

from data.packing import (
    IGNORE,
    best_fit_decreasing,
    pack_sequences,
    pad_sequences,
    split_long,
)

PAD = 0


def make_examples(lengths, prompt_fraction=0.5, seed=0):
    """Distinct token ids per example (example i uses 1000*(i+1) + position) and a prompt/answer mask."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for i, n in enumerate(lengths):
        tok = 1000 * (i + 1) + np.arange(n)
        prompt = int(n * prompt_fraction) if n else 0
        lab = tok.copy()
        lab[:prompt] = IGNORE
        if n and rng.random() < 0.2:
            lab[:] = IGNORE  # e.g. an empty assistant turn cut away: no label at all
        ids.append(tok)
        labels.append(lab)
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)  # noqa: E731
    return cat(ids), cat(labels), np.array(lengths, np.int64)


def segments(packed):
    """Every segment as (ids, labels, positions), read back from the rows through segment_ids."""
    out = []
    for r in range(packed.rows):
        seg = packed.segment_ids[r]
        for s in range(1, int(seg.max()) + 1 if seg.any() else 1):
            where = np.flatnonzero(seg == s)
            assert len(where) and np.all(np.diff(where) == 1), f"row {r} segment {s} is not contiguous"
            out.append((packed.input_ids[r, where], packed.labels[r, where], packed.position_ids[r, where]))
    return out


def check_lossless(packed, ids, labels, lengths, seq_len):
    """Reassemble each example from its pieces and compare with the input, token for token."""
    assert packed.input_ids.shape == (packed.rows, seq_len)
    assert packed.input_ids.dtype == np.int32
    pieces = segments(packed)
    for _, _, pos in pieces:
        np.testing.assert_array_equal(pos, np.arange(len(pos)))  # positions restart at each segment
    by_example: dict[int, list] = {}
    for seg_ids, seg_labels, _ in pieces:
        example = int(seg_ids[0]) // 1000 - 1
        by_example.setdefault(example, []).append((int(seg_ids[0]), seg_ids, seg_labels))
    starts = np.cumsum(lengths) - lengths
    assert sorted(by_example) == [i for i, n in enumerate(lengths) if n > 0]
    for i, parts in by_example.items():
        parts.sort(key=lambda p: p[0])
        got_ids = np.concatenate([p[1] for p in parts])
        got_labels = np.concatenate([p[2] for p in parts])
        np.testing.assert_array_equal(got_ids, ids[starts[i]:starts[i] + lengths[i]])
        np.testing.assert_array_equal(got_labels, labels[starts[i]:starts[i] + lengths[i]])
    pad = packed.segment_ids == 0
    assert np.all(packed.input_ids[pad] == PAD) and np.all(packed.labels[pad] == IGNORE)
    assert np.all(packed.position_ids[pad] == 0)
    assert packed.tokens == int(lengths.sum())
    assert packed.loss_tokens == int(np.count_nonzero(labels != IGNORE))


@pytest.mark.parametrize("fn", [pack_sequences, pad_sequences])
@pytest.mark.parametrize("lengths", [
    [5, 3, 8, 2, 7],          # mixed, fits in a few rows
    [16],                     # exact fit
    [16, 16, 1],              # two exact fits and a single token
    [40],                     # longer than the sequence: three pieces
    [17, 33, 1, 15],          # over by one, over twice, fillers
    [1] * 50,                 # many tiny examples
    [],                       # nothing at all
])
def test_every_token_exactly_once(fn, lengths):
    ids, labels, lens = make_examples(lengths)
    packed = fn(ids, labels, lens, 16, PAD)
    check_lossless(packed, ids, labels, lens, 16)


def test_random_lengths_property():
    rng = np.random.default_rng(7)
    for trial in range(30):
        seq_len = int(rng.integers(8, 64))
        lengths = rng.integers(1, 3 * seq_len, size=int(rng.integers(1, 60))).tolist()
        ids, labels, lens = make_examples(lengths, prompt_fraction=rng.random(), seed=trial)
        for fn in (pack_sequences, pad_sequences):
            check_lossless(fn(ids, labels, lens, seq_len, PAD), ids, labels, lens, seq_len)


def test_packing_fills_rows_and_pad_does_not():
    ids, labels, lens = make_examples([8, 8, 4, 4, 4, 4])
    packed = pack_sequences(ids, labels, lens, 16, PAD)
    assert packed.rows == 2 and packed.tokens == 32  # perfect packing exists and best-fit finds it
    padded = pad_sequences(ids, labels, lens, 16, PAD)
    assert padded.rows == 6 and np.all(padded.segment_ids.max(axis=1) == 1)


def test_segment_ids_number_segments_in_each_row():
    ids, labels, lens = make_examples([6, 5, 4])
    packed = pack_sequences(ids, labels, lens, 16, PAD)
    assert packed.rows == 1
    row = packed.segment_ids[0]
    assert row.tolist() == [1] * 6 + [2] * 5 + [3] * 4 + [0]


def test_exact_fit_has_no_padding():
    ids, labels, lens = make_examples([16, 16])
    packed = pack_sequences(ids, labels, lens, 16, PAD)
    assert packed.rows == 2 and np.all(packed.segment_ids == 1)


def test_labels_stay_masked_on_prompt_tokens():
    """A chat-like example: prompt tokens -100, answer tokens their own ids, pad -100."""
    ids = np.arange(100, 110, dtype=np.int32)
    labels = np.where(np.arange(10) >= 7, ids, IGNORE).astype(np.int32)
    packed = pack_sequences(ids, labels, np.array([10]), 16, PAD)
    assert packed.labels[0].tolist() == [IGNORE] * 7 + [107, 108, 109] + [IGNORE] * 6


def test_empty_assistant_turn_example_keeps_its_tokens():
    """An example with no label tokens (nothing to learn) is still placed whole, all -100."""
    ids = np.arange(1, 9, dtype=np.int32)
    labels = np.full(8, IGNORE, np.int32)
    packed = pack_sequences(ids, labels, np.array([8]), 8, PAD)
    assert packed.input_ids[0].tolist() == list(range(1, 9)) and packed.loss_tokens == 0


def test_split_long_pieces():
    start, length = split_long(np.array([3, 10, 0, 4]), 4)
    assert start.tolist() == [0, 3, 7, 11, 13] and length.tolist() == [3, 4, 4, 2, 4]


def test_best_fit_puts_each_piece_in_the_tightest_row():
    row, offset, segment, rows = best_fit_decreasing(np.array([10, 6, 5, 4]), 16)
    # 10 opens row 0 (room 6), 6 fills it, 5 opens row 1 (room 11), 4 goes there too.
    assert rows == 2 and row.tolist() == [0, 0, 1, 1] and offset.tolist() == [0, 10, 0, 5]
    assert segment.tolist() == [1, 2, 1, 2]


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="3 ids"):
        pack_sequences(np.arange(3), np.arange(3), np.array([4]), 8, PAD)


@pytest.mark.parametrize("fn", [pack_sequences, pad_sequences])
@pytest.mark.parametrize("lengths", [[40, 30, 70, 50, 64, 12, 33], [1, 2, 1, 3] * 20])
def test_rng_order_is_take_of_a_permutation(fn, lengths):
    """Long pieces take the slice-copy path, short ones the index path; either way `rng` gives the rows
    of the unordered result in `rng.permutation(rows)` order, nothing else changed."""
    ids, labels, lens = make_examples(lengths)
    plain = fn(ids, labels, lens, 64, PAD)
    ordered = fn(ids, labels, lens, 64, PAD, rng=np.random.default_rng(3))
    expected = plain.take(np.random.default_rng(3).permutation(plain.rows))
    for name in ("input_ids", "labels", "position_ids", "segment_ids"):
        np.testing.assert_array_equal(getattr(ordered, name), getattr(expected, name))
    check_lossless(ordered, ids, labels, lens, 64)
