"""Argument checks shared by the tree modules: integers, int64 arrays, class counts."""

from __future__ import annotations

import operator

import numpy as np

_INT64_MAX = np.iinfo(np.int64).max


def check_int(value, name, minimum=None):
    """Returns `value` as a Python int, or raises ValueError.

    Args:
      value: anything; Python and NumPy integers are accepted, bools are not
        (``True`` as a class count is almost certainly a bug).
      name: what to call the value in the error message.
      minimum: smallest allowed value, or None.

    Returns:
      The value as a Python int.

    Raises:
      ValueError: if `value` is not an integer or is below `minimum`.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    if not -2**63 <= result < 2**63:
        raise ValueError(f"{name} must fit in int64, got {result}")
    return result


def int_array(values, name, copy=False):
    """Converts `values` to a 1-D int64 array, or raises ValueError.

    Args:
      values: array-like of integers.
      name: what to call it in error messages.
      copy: always return a fresh array (needed before freezing it, so that a
        caller's own array is never made read-only behind its back).

    Returns:
      A 1-D int64 NumPy array.

    Raises:
      ValueError: if `values` is not 1-D or does not hold integers.
    """
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:  # ragged nesting and the like
        raise ValueError(f"{name} must be a 1-D array of integers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        # np.asarray([]) is float64; an empty list is still a valid int array.
        if arr.size == 0:
            return np.zeros(0, np.int64)
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > _INT64_MAX:
        raise ValueError(f"{name} has values beyond the int64 range")
    return np.array(arr, dtype=np.int64, copy=True) if copy else arr.astype(np.int64, copy=False)


def counts_array(counts, name="counts"):
    """Validates class counts: 1-D, non-empty, finite and non-negative.

    Integer counts stay int64 so that sums and ties are exact (Huffman's
    tie-breaking must be deterministic); they fall back to float64 only when an
    int64 sum of all of them could overflow. Other real counts become float64.

    Args:
      counts: array-like of non-negative numbers (frequencies or probabilities).
      name: what to call it in error messages.

    Returns:
      A 1-D int64 or float64 array.

    Raises:
      ValueError: if the counts are not a non-empty 1-D array of finite,
        non-negative numbers.
    """
    try:
        arr = np.asarray(counts)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D array of numbers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty: a tree needs at least one class")
    if arr.dtype.kind in "iu":
        if arr.dtype.kind == "i" and arr.min() < 0:
            bad = int(np.flatnonzero(arr < 0)[0])
            raise ValueError(f"{name}[{bad}] = {arr[bad]} is negative")
        # An upper bound on any partial sum; past 2^62 we give up exactness.
        if float(arr.max()) * arr.size >= 2.0**62:
            return arr.astype(np.float64)
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind != "f":
        raise ValueError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is not finite")
    if arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is negative")
    return arr
