"""Token ids and slot ids as compact C arrays: the conversion at the boundary, and the
common-prefix length of two arrays. Pure Python, no I/O."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

SLOT_CODE = "q"  # slot ids: one C array per tree node, per request, per match result


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
