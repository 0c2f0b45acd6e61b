"""Rotary position embeddings: the angular frequencies of a head's pairs under Hugging Face's
rope scalings, and the table of rotations a module with rotary embeddings is passed for each
call. Copied into a module whose dimensions include ``n_2`` (pairs over a whole head) or
``n_r`` (partial rotary: chunks of a head, the first two turn)."""

# -- stand-ins: the generated module defines these (not copied) --
import math

# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import _cos, _floats, _sin, _zeros

# -- end stand-ins --


def _rotary_frequencies(half, length, base, scaling):
    """The angular frequencies ``ω_m`` (a list of ``half``) of a head's rotary pairs and the
    amplitude of their ``cos, sin``: ``ω_m = base**(-m / half)``, as ``scaling`` changes them
    (``(kind, factor, original length, low, high, beta fast, beta slow, amplitude)``, the
    rope scalings of Hugging Face: linear, dynamic NTK, Llama 3, YaRN)."""
    kind, factor, original, low, high, beta_fast, beta_slow, amplitude = scaling
    dim = 2 * half
    if kind == "dynamic" and dim == 2:
        raise ValueError("params['W_Q']: dynamic NTK rotary scaling needs at least 2 "
                         "frequencies per head (its base grows as a power dim / (dim - 2)), "
                         "got 1")
    if kind == "dynamic" and length > original:  # the base grows with the length
        base = base * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    omega = [base ** (-m / half) for m in range(half)]
    if kind == "linear":
        omega = [w / factor for w in omega]
    elif kind == "llama3":  # long wavelengths slowed by factor, short kept, a ramp between
        scaled = []
        for w in omega:
            ramp = (original * w / (2 * math.pi) - low) / (high - low)
            scaled.append(w / factor + min(max(ramp, 0.0), 1.0) * (w - w / factor))
        omega = scaled
    elif kind == "yarn":  # frequencies below the ramp interpolated, above kept
        def turns(rotations):
            """The dimension index at which a frequency turns ``rotations`` times (float)."""
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        start, end = max(math.floor(turns(beta_fast)), 0), min(math.ceil(turns(beta_slow)), dim - 1)
        end = end + 0.001 if start == end else end
        omega = [w / factor + (1 - min(max((m - start) / (end - start), 0.0), 1.0))
                 * (w - w / factor) for m, w in enumerate(omega)]
        if not amplitude:
            amplitude = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    return omega, amplitude or 1.0


def _rotary(ns, length, chunks, half, base, scaling):
    """``(length, chunks, chunks, half)``: at position ``i`` over the first two chunks the
    rotation ``a [[cos, -sin], [sin, cos]]`` by ``i * ω_m`` of the pair ``(x[m], x[half + m])``
    of a head (``ω, a`` from ``_rotary_frequencies``), the identity over the other chunks."""
    X = ns["X"]
    omega, amplitude = _rotary_frequencies(half, length, base, scaling)
    angle = _floats([float(i) for i in range(length)], X)[:, None] * _floats(omega, X)
    cos, sin = amplitude * _cos(angle), amplitude * _sin(angle)
    table = _zeros(ns, (length, chunks, chunks, half))
    table[:, 0, 0], table[:, 0, 1], table[:, 1, 0], table[:, 1, 1] = cos, -sin, sin, cos
    for chunk in range(2, chunks):
        table[:, chunk, chunk] = 1
    return table
