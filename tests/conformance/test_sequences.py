"""How the prefill→decode and chunked-prefill checks cut a packed batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conformance.checks import sequences
from conformance.checks.catalogue import case_checks
from conformance.checks.kinds import Check


def test_decode_lengths_leave_a_prefill_in_every_sequence() -> None:
    assert sequences.decode_lengths((5, 17, 1, 41), 8) == [4, 8, 0, 8]
    assert sequences.decode_lengths((65,), None) == [64]
    assert sequences.decode_lengths((1,), 1) == [0]


def test_chunked_prefill_pieces_cover_each_sequence_once() -> None:
    seq_lens = (32, 2, 100)
    pieces = sequences.chunked_prefill_pieces(seq_lens)
    assert len(pieces) == 2  # bounded by the 2-token sequence
    for i, n in enumerate(seq_lens):
        ranges = [call[i] for call in pieces]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(lo < hi for lo, hi in ranges)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert sequences.chunked_prefill_pieces((65,)) == [[(0, 22)], [(22, 43)], [(43, 65)]]


def test_pieces_of_a_fixed_size() -> None:
    assert sequences.pieces_of((10,), 4) == [[(0, 4)], [(4, 8)], [(8, 10)]]
    assert sequences.pieces_of((10,), 10) == [[(0, 10)]]  # one call: the whole prefill
    assert sequences.pieces_of((8, 7), 4) == [[(0, 4), (0, 4)], [(4, 8), (4, 7)]]
    with pytest.raises(ValueError, match=r"need \[1, 2\] calls"):
        sequences.pieces_of((3, 7), 4)
    with pytest.raises(ValueError, match="piece_tokens must be >= 1"):
        sequences.pieces_of((3,), 0)


def test_gather_and_rows_agree() -> None:
    x = np.arange(10)[:, None]
    cu = sequences.offsets([4, 6])
    ranges = [(1, 3), (0, 2)]
    assert sequences.gather(x, cu, ranges)[:, 0].tolist() == [1, 2, 4, 5]
    assert sequences.rows(cu, ranges).tolist() == [1, 2, 4, 5]


def test_full_decode_only_for_short_sequences() -> None:
    assert "decode-all" in _names(case_checks((65,)))
    assert "decode-all" not in _names(case_checks((128,)))
    assert "decode-all-self" in _names(case_checks((5, 17, 1, 41)))


def _names(checks: list[Check]) -> list[str]:
    return [check.name for check in checks]
