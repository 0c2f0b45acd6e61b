"""Stand-ins for the names a generated module defines and its runtime reads: its data (written
by the template from the derivation) and its group tables. Never copied into a module: the
runtime files import these between their ``# -- stand-ins`` markers only so that they can be
linted as the plain Python they are; in a generated module the template's definitions stand
in their place. Shapes are tuples of dimension names (``"L"``, ``"d"``, ``"h*d_k"``); a node
is named by the key under which its group function stores it in a call's namespace."""

from collections.abc import Callable

Shape = tuple[str, ...]

PARAMS: tuple[tuple[str, Shape], ...] = ()
"""Parameters in order, as ``(name, shape)``."""

CONSTANTS: tuple[tuple[str, Shape], ...] = ()
"""Inputs computed for each call (masks, tables), passed in ``params`` beside the
parameters, as ``(name, shape)``."""

_BATCHED: tuple[str, ...] = ()
"""The constants that carry a leading batch axis ``B``."""

_ENGINE_SHAPES: dict[str, Shape] = {}
"""Shapes the engine works with where they differ from those passed (axes split out)."""

_CONSTANT_DIMS: dict[str, int] = {}
"""Dimensions fixed by the config (heads ``h``; ``n_2``/``n_r`` with rotary embeddings,
``n_u`` with relative position buckets, ``n_1`` with a pooled row)."""

INPUT_SHAPE: Shape = ()
"""The input ``X`` per sample."""

OUTPUT_SHAPE: Shape = ()
"""The output ``Z`` per sample."""

TARGET_SHAPE: Shape = ()
"""The target per sample (the output's, or without its classes for cross-entropy)."""

LOSS: str = ""
"""The loss: ``"mse"``, ``"cross_entropy"``, or ``"linear"`` (``Σ T∘Z``, for chains)."""

SCOPE: str = ""
"""What is derived: ``"all"``, or for a module read from a trace ``"products"`` or
``"blocks"``."""

STRUCTURED: tuple[tuple[str, str, str], ...] = ()
"""``(V, W, part)`` of every loss-Hessian block that ``kronecker_factors`` gives."""

_OUTPUT_NAME: str = ""
"""The node holding the output ``Z`` (engine shape)."""

_LOSS_NODE: str = ""
"""The node holding each sample's loss."""

_JVP_NODE: str = ""
"""The node holding the output's tangent along the joint direction (group ``jvp``)."""

_JOINT_GRADIENT_NODE: str = ""
"""The node holding each sample's gradient in its input (group ``hvp_joint``)."""

_JACOBIAN: dict[str, str] = {}
"""Variable → the node of its Jacobian ``∂Z/∂V``."""

_OUTPUT_HESSIAN: dict[tuple[str, str], str] = {}
"""``(V, W)`` → the node of the second derivative ``∂²Z/∂V∂W``."""

_LOSS_HESSIAN: dict[tuple[str, str, str], str] = {}
"""``(V, W, part)`` → the node of that part of the loss-Hessian block."""

_LOSS_HESSIAN_FULL: dict[tuple[str, str], str] = {}
"""``(V, W)`` → the node of the loss-Hessian block computed whole."""

_GRADIENT: dict[str, str] = {}
"""Variable → the node of the loss gradient in it."""

_PER_SAMPLE_GRADIENT: dict[str, str] = {}
"""Variable → the node of each sample's own loss gradient in it."""

_PER_SAMPLE_JOINT_HVP: dict[str, str] = {}
"""Parameter → the node of each sample's own joint Hessian-vector product in it."""

_PER_SAMPLE_JOINT_GNVP: dict[str, str] = {}
"""Parameter → the node of each sample's own joint Gauss–Newton-vector product in it."""

_HVP: dict[str, str] = {}
"""Variable → the node of the Hessian-vector product in it."""

_DIRECTIONS: dict[str, str] = {}
"""Variable → the node the direction of ``hvp``/``gnvp`` in it is bound to."""

_JOINT_HVP: dict[str, str] = {}
"""Variable → the node of the joint Hessian-vector product in it."""

_JOINT_DIRECTIONS: dict[str, str] = {}
"""Variable → the node the joint direction in it is bound to."""

_GNVP: dict[str, str] = {}
"""Parameter → the node of the Gauss–Newton-vector product in it."""

_JOINT_GNVP: dict[str, str] = {}
"""Variable → the node of the joint Gauss–Newton-vector product in it."""

_KRONECKER: dict[tuple[str, str, str], tuple[tuple[str | None, str | None], ...]] = {}
"""``(V, W, part)`` → the nodes of each Kronecker product's factors (None: an identity)."""

_DIAGONAL: dict[tuple[str, str], str] = {}
"""``(V, part)`` → the node of the diagonal of that part of the block ``(V, V)``."""

_DIAGONAL_ROWS: dict[tuple[str, str], str] = {}
"""``(V, part)`` → the node of that diagonal on the rows a selector picks."""

_ROW_DIRECTIONS: dict[str, str] = {}
"""Parameter → the node its row selector is bound to (those with a diagonal on rows)."""

_ROW_TANGENTS: dict[str, tuple[Shape, ...]] = {}
"""Parameter → the shapes (per sample and row) of the tangents its diagonal on rows holds."""

_GROUPS: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {}
"""Group name → its generated function (of a call's namespace) and the groups it requires."""

_WRITES: dict[str, tuple[str, ...]] = {}
"""Group name → the nodes its function stores in the namespace."""
