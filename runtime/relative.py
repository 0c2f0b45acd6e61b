"""T5's relative position buckets: the bucket of each key's offset from its query, and the
one-hot table of them a module with a relative position bias is passed for each call. Copied
into a module whose dimensions include ``n_u`` (the buckets)."""

# -- stand-ins: the generated module defines these (not copied) --
import math

# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import _indices, _one_hot

# -- end stand-ins --


def _bucket(offset, buckets, max_distance, bidirectional):
    """T5's bucket of the offset ``j - i`` of a key from its query: the nearest offsets
    exactly, farther ones in logarithmic bins up to ``max_distance`` (each direction its own
    half of the buckets when ``bidirectional``; else only keys before the query count)."""
    first = 0
    if bidirectional:
        buckets //= 2
        first, distance = (buckets if offset > 0 else 0), abs(offset)
    else:
        distance = max(-offset, 0)
    exact = buckets // 2
    if distance < exact:
        return first + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact)
                      * (buckets - exact))
    return first + min(far, buckets - 1)


def _relative_buckets(ns, length, buckets, max_distance, bidirectional):
    """``(length, length, buckets)``: 1 at ``[i, j, bucket(j - i)]``, 0 elsewhere."""
    index = [[_bucket(j - i, buckets, max_distance, bidirectional) for j in range(length)]
             for i in range(length)]
    return _one_hot(_indices(index, ns["X"]), buckets, ns["X"])
