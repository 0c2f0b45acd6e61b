"""The runtime of a generated module, written once as plain Python and copied into every module
by the generator (:mod:`curvgap.codegen.runtime`), so that each module stays standalone: it
imports nothing but ``math`` and its array library.

- ``numpy_arrays.py``, ``torch_arrays.py``: the backend's array primitives (the same names in
  both; a module holds its backend's);
- ``arguments.py``: checks of arguments as pure functions of what they are given (shapes in
  dimension names, finite values, ``wrt`` and ``part``, a direction split by parameter, the
  caller's ``out=`` arrays, a result checked for overflow);
- ``namespace.py``: a call's namespace (inputs bound, groups run and released);
- ``contract.py``: the public API over the module's groups;
- ``saved.py``: the ``*_saved`` functions that chain modules;
- ``rotary.py``, ``relative.py``, ``pooling.py``: tables passed to modules with rotary
  embeddings, T5's relative position buckets or a pooled row, copied only into those.

Each file starts with its docstring and a block between ``# -- stand-ins`` and
``# -- end stand-ins --`` that imports what the generated module defines around it (its data
and group tables, stubbed in ``_module_names.py``, and the other runtime files' functions);
the generator copies the text below that block, the docstring as a comment above it.
"""
