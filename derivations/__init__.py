"""The symbolic engine: index-form tensor calculus on SymPy, and the sublayers built on it."""
