"""The paper's block-dominance statements as tests on block norms (analysis/dominance.py),
on norms made up so that each statement's verdict is known."""

from __future__ import annotations

import pytest

from curvgap.analysis import dominance

NAMES = ("Q", "K", "V", "1", "2")


def norms(**given: float) -> dominance.Norms:
    """Every block at 1 except those given as ``QK=3`` (both orders)."""
    found = {(a, b): 1.0 for a in NAMES for b in NAMES}
    for key, value in given.items():
        found[key[0], key[1]] = found[key[1], key[0]] = value
    return found


def verdict(name: str, initial: dominance.Norms, trained: dominance.Norms) -> bool:
    return {v.statement: v.agrees for v in dominance.verdicts(initial, trained)}[name]


@pytest.mark.parametrize("initial, agrees", [(norms(VQ=2.0), True), (norms(QK=2.0), False),
                                             (norms(VV=2.0, KK=3.0), False)])
def test_values_larger_at_initialisation(initial, agrees):
    statement = "at initialisation the Value-related blocks are the larger ones"
    assert verdict(statement, initial, norms()) is agrees


def test_every_block_grows_names_the_blocks_that_do_not():
    initial, trained = norms(), norms(**{"12": 0.5})
    trained = {k: v * 2 if k not in (("1", "2"), ("2", "1")) else v for k, v in trained.items()}
    found = {v.statement: v for v in dominance.verdicts(initial, trained)}
    grows = found["after training every block grows"]
    assert not grows.agrees and "14 of 15" in grows.measured and "(not: 1–2)" in grows.measured
    doubled = {k: 2 * v for k, v in initial.items()}
    assert verdict("after training every block grows", initial, doubled)


@pytest.mark.parametrize("trained, largest, attention, top_two, dominate", [
    (norms(VV=5.0, KK=4.0), True, True, True, True),
    (norms(VV=5.0, **{"22": 6.0}), False, True, False, False),
    (norms(KK=5.0, VV=2.0, QQ=3.0), False, False, False, True),
])
def test_statements_after_training(trained, largest, attention, top_two, dominate):
    initial = norms(VV=5.0, KK=4.0)
    assert verdict("after training the V–V block is the largest", initial, trained) is largest
    assert verdict("after training V–V is the largest attention block", initial,
                   trained) is attention
    assert verdict("Keys and Values have the largest Hessian blocks, the others much smaller",
                   initial, trained) is top_two
    assert verdict("Value- and Key-related blocks dominate", initial, trained) is dominate
