"""Tokenized examples -> fixed-length rows, by packing several into a row or padding each to its own.

Inputs are flat arrays (every example's token ids end to end, its labels likewise) plus one length per
example, the layout Arrow list columns already have. Outputs are (rows, seq_len) int32 arrays:
  input_ids     tokens, `pad_id` after the last segment
  labels        the example's labels (-100 where masked), -100 on padding
  position_ids  0, 1, 2 ... restarting at every segment start; 0 on padding
  segment_ids   1..k for the k segments in a row, 0 on padding
An example longer than seq_len is cut into seq_len pieces, each its own segment, so nothing is lost
here; whether a long example may be split, cut or rejected is the caller's decision.
Everything is vectorised except the bin choice, which is one bisect per segment.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

IGNORE = -100


@dataclass
class PackedRows:
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Non-pad tokens."""
        return int(np.count_nonzero(self.segment_ids))

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.labels != IGNORE))

    def take(self, order: np.ndarray) -> "PackedRows":
        return PackedRows(self.input_ids[order], self.labels[order], self.position_ids[order], self.segment_ids[order])


def split_long(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of at most seq_len tokens: (start in the flat arrays, length) per piece, in example order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    n_pieces = -(-lengths // seq_len)  # ceil; an empty example gives no piece
    example = np.repeat(np.arange(len(lengths)), n_pieces)
    k = np.arange(int(n_pieces.sum())) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    return starts[example] + k * seq_len, np.minimum(seq_len, lengths[example] - k * seq_len)


def best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Assign pieces (each <= seq_len) to rows: longest first, each into the row it fills most tightly
    (of rows with the same room left, the first opened).

    Returns (row, offset in row, segment number 1..k in row) per piece and the number of rows.
    """
    n = len(lengths)
    row, offset, segment = [0] * n, [0] * n, [0] * n
    fill: list[int] = []
    segments: list[int] = []
    # Rows with room left, as room << 32 | row (one int compares faster than a tuple), sorted: the first at or
    # past size << 32 has the least room that fits the piece, and of those the lowest row.
    free: list[int] = []
    length_list = np.asarray(lengths).tolist()
    for p in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        size = length_list[p]
        i = bisect.bisect_left(free, size << 32)
        if i < len(free):
            packed = free.pop(i)
            room, r = packed >> 32, packed & 0xFFFFFFFF
        else:
            room, r = seq_len, len(fill)
            fill.append(0)
            segments.append(0)
        row[p], offset[p] = r, fill[r]
        fill[r] += size
        segments[r] += 1
        segment[p] = segments[r]
        if room > size:
            bisect.insort(free, (room - size) << 32 | r)
    return (np.array(row, np.int64), np.array(offset, np.int64), np.array(segment, np.int64), len(fill))


# Pieces at least this long on average are copied slice by slice (one memcpy per column and piece);
# shorter ones by index arrays over every token, which costs more per token but less per piece.
_SLICE_COPY_MIN_MEAN = 32


def _scatter(input_ids, labels, piece_start, piece_len, dest_row, offset, segment, rows, seq_len, pad_id,
             order: np.ndarray | None = None) -> PackedRows:
    """Copy each piece to (dest_row, offset); with `order` (a permutation of the rows) the result is
    `PackedRows.take(order)` of the unordered one, without the extra copy."""
    if order is not None:
        inverse = np.empty(rows, np.int64)
        inverse[order] = np.arange(rows)
        dest_row = inverse[dest_row]
    dest = dest_row * seq_len + offset
    out = PackedRows(
        np.full(rows * seq_len, pad_id, np.int32), np.full(rows * seq_len, IGNORE, np.int32),
        np.zeros(rows * seq_len, np.int32), np.zeros(rows * seq_len, np.int32),
    )
    total = int(piece_len.sum())
    if len(piece_len) and total >= _SLICE_COPY_MIN_MEAN * len(piece_len):
        positions = np.arange(seq_len, dtype=np.int32)
        o_ids, o_labels, o_pos, o_seg = out.input_ids, out.labels, out.position_ids, out.segment_ids
        for s, n, d, k in zip(piece_start.tolist(), piece_len.tolist(), dest.tolist(), segment.tolist()):
            o_ids[d:d + n] = input_ids[s:s + n]
            o_labels[d:d + n] = labels[s:s + n]
            o_pos[d:d + n] = positions[:n]
            o_seg[d:d + n] = k
    elif total:
        within = np.arange(total) - np.repeat(np.cumsum(piece_len) - piece_len, piece_len)
        src = np.repeat(piece_start, piece_len) + within
        dst = np.repeat(dest, piece_len) + within
        out.input_ids[dst] = input_ids[src]
        out.labels[dst] = labels[src]
        out.position_ids[dst] = within
        out.segment_ids[dst] = np.repeat(segment, piece_len)
    shape = (rows, seq_len)
    return PackedRows(*(a.reshape(shape) for a in (out.input_ids, out.labels, out.position_ids, out.segment_ids)))


def _check_inputs(name: str, input_ids, labels, lengths) -> tuple[np.ndarray, np.ndarray]:
    input_ids, labels = np.asarray(input_ids, np.int32), np.asarray(labels, np.int32)
    if len(input_ids) != int(np.sum(lengths)) or len(labels) != len(input_ids):
        raise ValueError(f"{name}: {len(input_ids)} ids and {len(labels)} labels for lengths "
                         f"summing to {int(np.sum(lengths))}")
    return input_ids, labels


def pack_sequences(input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, seq_len: int,
                   pad_id: int, rng: np.random.Generator | None = None) -> PackedRows:
    """Pack examples (flat ids/labels + lengths) into as few seq_len rows as best-fit-decreasing finds.
    With `rng` the rows come out in `rng.permutation(rows)` order (best-fit makes them longest-first)."""
    input_ids, labels = _check_inputs("pack_sequences", input_ids, labels, lengths)
    start, length = split_long(lengths, seq_len)
    row, offset, segment, rows = best_fit_decreasing(length, seq_len)
    order = rng.permutation(rows) if rng is not None else None
    return _scatter(input_ids, labels, start, length, row, offset, segment, rows, seq_len, pad_id, order)


def pad_sequences(input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, seq_len: int,
                  pad_id: int, rng: np.random.Generator | None = None) -> PackedRows:
    """One example (or one seq_len piece of a longer one) per row, padded to seq_len; `rng` as for
    `pack_sequences`."""
    input_ids, labels = _check_inputs("pad_sequences", input_ids, labels, lengths)
    start, length = split_long(lengths, seq_len)
    rows = len(length)
    order = rng.permutation(rows) if rng is not None else None
    return _scatter(input_ids, labels, start, length, np.arange(rows), np.zeros(rows, np.int64),
                    np.ones(rows, np.int64), rows, seq_len, pad_id, order)
