"""The paper's statements about which Hessian blocks dominate (Sec. 5, Figures 3–5, and the
discussion of Sec. 6), checked against measured block norms.

A measurement is the spectral norm ``‖H_ab‖₂`` of every block ``H_ab = ∂²ℓ/∂W_a∂W_b`` of a
block's loss Hessian, ``a, b ∈ {Q, K, V, 1, 2}``, at initialisation and after training.
Each statement becomes a test on those numbers, with its verdict and the numbers it rests
on; the attention blocks are those with ``a, b ∈ {Q, K, V}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .bounds import ATTENTION

Norms = dict[tuple[str, str], float]


def _name(block: tuple[str, str]) -> str:
    return f"{block[0]}–{block[1]}"


def _largest(norms: Norms, keep: Callable[[tuple[str, str]], bool] = lambda b: True
             ) -> tuple[str, str]:
    return max((b for b in norms if keep(b)), key=lambda b: norms[b])


def _attention(block: tuple[str, str]) -> bool:
    return block[0] in ATTENTION and block[1] in ATTENTION


def _diagonal_order(norms: Norms) -> list[str]:
    return sorted((a for a, b in norms if a == b), key=lambda a: -norms[a, a])


@dataclass(frozen=True)
class Verdict:
    """One statement, where the paper makes it, what was measured, and whether they agree."""

    statement: str
    where: str
    measured: str
    agrees: bool

    def as_dict(self) -> dict:
        return {"statement": self.statement, "where": self.where, "measured": self.measured,
                "agrees": self.agrees}


def values_larger_at_initialisation(initial: Norms, trained: Norms) -> Verdict:
    """Figure 3: at initialisation the largest attention block involving ``V`` exceeds the
    largest attention block without it."""
    top_v = _largest(initial, lambda b: _attention(b) and "V" in b)
    top_rest = _largest(initial, lambda b: _attention(b) and "V" not in b)
    return Verdict("at initialisation the Value-related blocks are the larger ones",
                   "Sec. 5, Figure 3",
                   f"largest V-related attention block {_name(top_v)} {initial[top_v]:.3g}, "
                   f"largest other attention block {_name(top_rest)} {initial[top_rest]:.3g}",
                   initial[top_v] > initial[top_rest])


def every_block_grows(initial: Norms, trained: Norms) -> Verdict:
    """Figure 4: every block's norm is larger after training (``H_ba = H_abᵀ``, so each
    unordered pair counts once)."""
    pairs = [(a, b) for a, b in initial if (b, a) not in initial or a <= b]
    shrunk = [_name(p) for p in pairs if trained[p] <= initial[p]]
    return Verdict("after training every block grows", "Sec. 5, Figure 4",
                   f"{len(pairs) - len(shrunk)} of {len(pairs)} blocks grow"
                   + (f" (not: {', '.join(shrunk)})" if shrunk else ""), not shrunk)


def values_values_largest_after_training(initial: Norms, trained: Norms) -> Verdict:
    """Figure 4: after training ``V–V`` is the largest of all blocks."""
    top = _largest(trained)
    return Verdict("after training the V–V block is the largest", "Sec. 5, Figure 4",
                   f"largest block {_name(top)} {trained[top]:.3g}; V–V {trained['V', 'V']:.3g}",
                   top == ("V", "V"))


def values_values_largest_attention_block(initial: Norms, trained: Norms) -> Verdict:
    """The same statement among the attention blocks only (``a, b ∈ {Q, K, V}``)."""
    top = _largest(trained, _attention)
    return Verdict("after training V–V is the largest attention block", "Sec. 5, Figure 4",
                   f"largest attention block {_name(top)} {trained[top]:.3g}; V–V "
                   f"{trained['V', 'V']:.3g}", top == ("V", "V"))


def keys_and_values_highest(initial: Norms, trained: Norms) -> Verdict:
    """Figure 5: the ``K–K`` and ``V–V`` blocks are the two largest diagonal blocks, before
    and after training."""
    orders = {state: _diagonal_order(norms)
              for state, norms in (("initialisation", initial), ("trained", trained))}
    return Verdict("Keys and Values have the largest Hessian blocks, the others much smaller",
                   "Sec. 5, Figure 5",
                   "; ".join(f"{state}: " + " > ".join(f"{a}–{a}" for a in order)
                             for state, order in orders.items()),
                   all(set(order[:2]) == {"K", "V"} for order in orders.values()))


def values_and_keys_dominate(initial: Norms, trained: Norms) -> Verdict:
    """Sec. 6: after training the largest block involving ``V`` or ``K`` exceeds every block
    involving neither."""
    def related(block: tuple[str, str]) -> bool:
        return "V" in block or "K" in block

    top_related, top_rest = _largest(trained, related), _largest(trained, lambda b: not related(b))
    return Verdict("Value- and Key-related blocks dominate", "Sec. 6",
                   f"after training: largest V- or K-related block {_name(top_related)} "
                   f"{trained[top_related]:.3g}, largest other {_name(top_rest)} "
                   f"{trained[top_rest]:.3g}", trained[top_related] > trained[top_rest])


STATEMENTS = (values_larger_at_initialisation, every_block_grows,
              values_values_largest_after_training, values_values_largest_attention_block,
              keys_and_values_highest, values_and_keys_dominate)


def verdicts(initial: Norms, trained: Norms) -> list[Verdict]:
    """Every statement of :data:`STATEMENTS` on the block norms before and after training
    (keys ``(a, b)`` with ``a, b`` among ``Q K V 1 2``)."""
    return [statement(initial, trained) for statement in STATEMENTS]
