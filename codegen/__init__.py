"""From derivations to files: lowering to array programs, the backends that print them,
hashed and atomic generation, and the numerical verification of generated modules."""
