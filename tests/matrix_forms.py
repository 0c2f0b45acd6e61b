"""The check that every matrix form a document prints equals the engine's index form."""

from __future__ import annotations

import numpy as np

from curvgap.codegen.backends.latex.document import _notation, builder_for


def assert_matrix_forms(der, values: dict, dims: dict, atol_of_largest: bool = False) -> int:
    """Evaluate each matrix form of ``der``'s document (explicit Kronecker, commutation and
    diag matrices) and compare it with the index form's value in ``values``, laid out in
    the paper's rows and columns; ``atol_of_largest``: the absolute tolerance is relative to
    the block's largest entry (long sums of large products). The number of forms checked."""
    builder = builder_for(der, _notation(der))
    checked = 0
    for assign in der.graph.assigns:
        matrix = builder.matrix(assign)
        if matrix is None or matrix[2] is None:
            continue
        rows, cols, form = matrix
        array, indices = values[assign.target.name], assign.target.indices
        n_rows = int(np.prod([array.shape[indices.index(i)] for i in rows]))
        expected = np.transpose(array, [indices.index(i) for i in rows + cols]).reshape(
            n_rows, -1)
        atol = 1e-12 * (max(1.0, np.abs(expected).max()) if atol_of_largest else 1.0)
        np.testing.assert_allclose(form.evaluate(values, dims), expected, rtol=1e-12,
                                   atol=atol, err_msg=assign.target.name)
        checked += 1
    return checked
