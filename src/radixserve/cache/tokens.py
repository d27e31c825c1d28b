"""Token ids and slot ids as compact C arrays: the conversion at the boundary, and the
common-prefix length of two arrays. Pure Python, no I/O."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from functools import cache

SLOT_CODE = "q"  # slot ids: one C array per tree node, per request, per match result
IOTA_LANES = 1 << 16  # ids of one run of ``slot_iota``: they differ in their low 2 bytes only
_W = array(SLOT_CODE).itemsize


def token_array(ids: Sequence[int]) -> array:
    """Token ids as a compact array, converted once at the boundary (tokenizer, request):
    ``array('I')`` when every id fits 32 bits, ``array('Q')`` otherwise (a tree's key types);
    ValueError for ids outside [0, 2**64)."""
    if type(ids) is array and ids.typecode in "IQ":
        return ids
    out = array("I")
    try:
        out.fromlist(ids if type(ids) is list else list(ids))
        return out
    except (OverflowError, TypeError):
        out = array("Q")
    try:
        out.fromlist(list(ids))
    except (OverflowError, TypeError) as e:
        raise ValueError("token ids must be ints in [0, 2**64)") from e
    return out


def concat_tokens(ids: array, more: list[int]) -> array:
    """``ids`` followed by ``more`` (generated ids, a list), in one array of ``ids``'s type,
    widened to 64 bits if an id of ``more`` does not fit it."""
    out = array(ids.typecode, ids)
    try:
        out.fromlist(more)
        return out
    except (OverflowError, TypeError):
        return token_array(ids.tolist() + more)


def common_len(key: array, query: array, start: int, end: int) -> int:
    """Length of the common prefix of ``key`` and ``query[start:end]``, for a caller that found
    they are not equal over the whole of ``key``.

    C-speed slice comparisons: one for a query that ends inside the key, then a binary search
    for where a mismatch lies that compares only the half still in doubt, so O(n) in all."""
    n = len(key)
    if end - start < n:
        n = end - start
        if query[start:end] == key[:n]:
            return n
    lo, hi = 0, n  # key[:lo] == query[start:start+lo]; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == query[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def slot_iota(lo: int, hi: int) -> bytearray:
    """The raw bytes of ``array(SLOT_CODE, range(lo, hi))`` (0 <= lo <= hi < 2**63), made
    without an int object per id: the ids of one aligned run of ``IOTA_LANES`` differ only in
    their low bytes, so a run is a copy of the ids 0 .. IOTA_LANES - 1 with each high byte of
    the run's start written into every id at once (a strided byte fill, in C). A host tier's
    ids cost a few instructions each (the big-int lanes this replaced cost ~200)."""
    if hi - lo < 64:
        return bytearray(array(SLOT_CODE, range(lo, hi)).tobytes())
    out = bytearray((hi - lo) * _W)
    with memoryview(_iota_low()) as low:
        for run in range(lo // IOTA_LANES, (hi - 1) // IOTA_LANES + 1):
            start = run * IOTA_LANES
            a, b = max(lo, start) - start, min(hi, start + IOTA_LANES) - start
            at = (start + a - lo) * _W  # where this run's ids go in ``out``
            out[at : at + (b - a) * _W] = low[a * _W : b * _W]
            for i, byte in enumerate(start.to_bytes(_W, sys.byteorder)):
                if byte:  # this byte of every id in the run (start's low bytes are 0)
                    out[at + i : at + (b - a) * _W : _W] = bytes((byte,)) * (b - a)
    return out


@cache
def _iota_low() -> bytes:
    """The raw bytes of the ids 0 .. IOTA_LANES - 1: two strided byte fills (the ids' two low
    bytes; the others are 0), not a conversion per id."""
    out = bytearray(IOTA_LANES * _W)
    first = 0 if sys.byteorder == "little" else _W - 1
    second = first + (1 if first == 0 else -1)
    out[first::_W] = bytes(range(256)) * (IOTA_LANES // 256)
    out[second::_W] = b"".join(bytes((v,)) * 256 for v in range(IOTA_LANES // 256))
    return bytes(out)
