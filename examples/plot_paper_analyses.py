"""
The paper's analyses: its bounds against the exact norms
=========================================================

"Closing the Curvature Gap" bounds the spectral norm of the loss Hessian of self-attention
(Theorem 1, ``‖H‖ ≤ M``) and of the post-LN block (Theorem 6), from the norms of the
weights and the input only. With the exact Hessian at hand, each bound can be divided by
the true norm it bounds: a ratio below 1 is a violation.

This example evaluates Theorem 1 on random instances, then at two instances found by a
worst-case search, where the printed ``M`` and App. B.6's ``‖G_Q‖`` bound fail, and shows
why. ``curvgap reproduce`` runs every analysis of the paper (all bounds and their
ingredients, the search, the block structure before and after training, the scaling
exponents, Theorem 7's convergence) and writes a report with its figures.
"""

# %%
# Theorem 1 on random instances
# -----------------------------
#
# ``analysis.bounds.random_instance(seed, block=False)`` draws one self-attention sample
# (sizes ``L ∈ 2..24``, ``d ∈ 2..5``, ``d_k ∈ 1..4``; weights and input of random scale);
# ``bounds.theorem1`` evaluates the main-text and appendix bounds of every block and of
# ``M``, each against the exact norm from the generated ``self_attention`` module.

import time

import matplotlib.pyplot as plt
import numpy as np

from curvgap.analysis import bounds, search

start = time.perf_counter()
ratios: dict[tuple[str, str], list[float]] = {}
for seed in range(200):
    instance = bounds.random_instance(seed, block=False)
    for check in bounds.theorem1(instance.params, instance.X, instance.target):
        ratios.setdefault((check.theorem, check.quantity), []).append(check.ratio)
print(f"200 instances in {time.perf_counter() - start:.1f} s")
shown = [("Theorem 1 (main text)", "M ≥ ‖H‖"), ("Theorem 1 (appendix)", "M ≥ ‖H‖"),
         ("Theorem 1 (appendix)", "H(Q,Q) Gauss–Newton"), ("App. B.6 Gk_bounds", "‖G_Q‖"),
         ("Theorem 1 (appendix)", "H(V,V)")]
for key in shown:
    values = np.array(ratios[key])
    print(f"  {key[0]:22s} {key[1]:22s} smallest bound/true {values.min():9.3g}, "
          f"median {np.median(values):9.3g}, violated on {int((values < 1).sum())}")

# %%
# Where the search finds violations
# ---------------------------------
#
# ``analysis.search`` minimises bound/true over sizes and per-weight scales instead of
# sampling. An instance is ``search.Spec(block, seed, dims, scales)``: ``W = e^{s_W} G_W``,
# ``X = e^{s_x}(G_X + e^{s_c} m 1ᵀ)``, ``T = e^{s_t} G_T`` with standard normal ``G``.
#
# *The printed M.* Its four arguments bound the ``(V,V)``, ``(Q,Q)``, ``(V,Q)`` and
# ``(Q,K)`` blocks, and the ``(Q,Q)`` one grows with ``‖W_K‖`` only. With ``‖W_Q‖ ≫ ‖W_K‖``
# the ``(K,K)`` block, of order ``‖W_Q‖²``, is covered by none of them. The maximum over all
# six blocks (which the proof's last step assembles over) holds.

found = {}
m_instance = search.Spec(False, 20381, {"L": 2, "d": 2, "d_k": 3, "d_ff": 2},
                         {"s_Q": 3.0, "s_K": -4.78898, "s_V": -4.520437, "s_x": -0.735424,
                          "s_c": -3.457074, "s_t": 3.0})
for check in search.checks(m_instance):
    if check.quantity.startswith("M ≥"):
        found[check.theorem, check.quantity] = check
        print(f"  {check.theorem:22s} {check.quantity:28s} bound {check.bound:9.3g}  "
              f"true {check.true:9.3g}  ratio {check.ratio:.3f}")

# %%
# *The Gauss–Newton (Q,Q) block and* ``‖G_Q‖``. For one sample's mean squared error the
# Gauss–Newton ``(Q,Q)`` block is ``(2/(L d)) G_Qᵀ G_Q`` with ``G_Q = ∂F/∂W_Q``, and the
# appendix bounds it by ``(2/(L d))`` times the square of App. B.6's bound on ``‖G_Q‖``.
# That bound takes ``‖∂A/∂T‖ ≤ 1/L`` (step 1 of Theorem 1's proof), which holds for uniform
# attention only; at this instance both bounds fail, and the first ratio is the second's
# square.

g_instance = search.Spec(False, 20036, {"L": 17, "d": 2, "d_k": 2, "d_ff": 6},
                         {"s_Q": -1.612329, "s_K": -2.343696, "s_V": 2.167562,
                          "s_x": 1.025043, "s_c": -1.622052, "s_t": -2.707051})
checks = {(c.theorem, c.quantity): c for c in search.checks(g_instance)}
gauss_newton = checks["Theorem 1 (appendix)", "H(Q,Q) Gauss–Newton"]
g_q = checks["App. B.6 Gk_bounds", "‖G_Q‖"]
for check in (gauss_newton, g_q):
    print(f"  {check.quantity:22s} bound {check.bound:9.4g}  true {check.true:9.4g}  "
          f"ratio {check.ratio:.3f}")
print(f"  ratio of ‖G_Q‖, squared: {g_q.ratio ** 2:.3f}")
found["Theorem 1 (appendix)", "H(Q,Q) Gauss–Newton"] = gauss_newton
found["App. B.6 Gk_bounds", "‖G_Q‖"] = g_q

# %%
# The picture
# -----------
#
# Each bound's ratios over the random instances (one dot per instance), with the searched
# instances in red. On typical inputs ``M`` is loose by orders of magnitude, the block and
# ``‖G_Q‖`` bounds by a few times; on some inputs each of the last three fails.

fig, ax = plt.subplots(figsize=(10, 4.8))
for row, key in enumerate(shown):
    values = np.array(ratios[key])
    jitter = np.random.default_rng(row).uniform(-0.18, 0.18, len(values))
    ax.scatter(values, row + jitter, s=10, color="C0", alpha=0.6,
               label="random instances" if row == 0 else None)
    if key in found:
        ax.scatter([found[key].ratio], [row], s=80, marker="D", color="C3",
                   label="searched instance" if row == 0 else None)
ax.axvline(1, color="k", lw=1, label="bound = exact norm")
ax.set_xscale("log")
ax.set_yticks(range(len(shown)), [f"{theorem}\n{quantity}" for theorem, quantity in shown],
              fontsize=9)
ax.set_xlabel("bound / exact norm  (below 1: violated)")
ax.set_xlim(left=0.5 * min(c.ratio for c in found.values()))
ax.legend(loc="lower right", fontsize=9)
ax.set_title("Theorem 1 and its ingredients against the exact Hessian")
fig.tight_layout()

# %%
# Every bound, every block
# ------------------------
#
# ``curvgap reproduce --quick`` (about a minute) or ``curvgap reproduce`` (a few minutes)
# runs all of this for every bound of Theorems 1 and 6 and every ingredient, the worst-case
# search, and the paper's other analyses, and writes ``report.md`` with its figures.
