"""Assertions shared by the piece-store tests."""

from __future__ import annotations

import numpy as np


def assert_same(expected: np.ndarray, actual: np.ndarray) -> None:
    """Assert dtype, shape and content (byte-exact for fixed-width dtypes) are equal."""
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.flags.c_contiguous
    assert actual.flags.writeable
    if expected.dtype.hasobject:
        assert actual.tolist() == expected.tolist()
    else:
        assert actual.tobytes() == np.ascontiguousarray(expected).tobytes()
