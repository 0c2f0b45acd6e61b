"""The ``curvgap`` command line:

``curvgap generate [--config FILE ...] [--out DIR] [--check] [--force] [--no-verify]``
``curvgap latex NAME [--out DIR] [--pdf]``
``curvgap bench [--config NAME] [--quick] [--out DIR]`` (or ``--scale``, ``--accuracy``,
``--distributed``, ``--models [--device cuda] [--fused]``; ``--scale [--fused]``)
``curvgap reproduce [--quick] [--out DIR]``

:mod:`.commands` parses and runs them, :mod:`.arguments` checks their arguments,
:mod:`.verification` prints the table ``generate`` verifies with.
"""

from .commands import main

__all__ = ["main"]
