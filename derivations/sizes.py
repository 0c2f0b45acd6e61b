"""The size symbols: batch, sequence length, widths, heads, rotary halves, input features,
classes, the rows of a parameter a chunked diagonal takes at once, and the rows of a
cross-attention's second input."""

import sympy as sp

L = sp.Symbol("L", positive=True, integer=True)
d = sp.Symbol("d", positive=True, integer=True)
d_k = sp.Symbol("d_k", positive=True, integer=True)
d_ff = sp.Symbol("d_ff", positive=True, integer=True)
h = sp.Symbol("h", positive=True, integer=True)      # heads (a config constant)
d_v = sp.Symbol("d_v", positive=True, integer=True)  # value width per head, d / h
B = sp.Symbol("B", positive=True, integer=True)    # batch (the generated code's leading axis)
g = sp.Symbol("g", positive=True, integer=True)      # key/value heads (a config constant)
r = sp.Symbol("r", positive=True, integer=True)      # query heads per key/value head, h / g
d_r = sp.Symbol("d_r", positive=True, integer=True)  # rotary frequencies per head, d_k / 2
n_2 = sp.Symbol("n_2", positive=True, integer=True)  # the two halves a rotary pair spans, 2
n_r = sp.Symbol("n_r", positive=True, integer=True)  # chunks of d_r a head spans, partial rotary
p = sp.Symbol("p", positive=True, integer=True)      # input features of an embedding
c = sp.Symbol("c", positive=True, integer=True)      # classes (outputs) of a head
n_u = sp.Symbol("n_u", positive=True, integer=True)  # relative-position buckets (a constant)
n_1 = sp.Symbol("n_1", positive=True, integer=True)  # the one row a pooling keeps, 1
R = sp.Symbol("R", positive=True, integer=True)      # rows of a parameter taken at once
L_m = sp.Symbol("L_m", positive=True, integer=True)  # rows of a cross-attention's second input
