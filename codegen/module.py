"""The variables of a generated module's templates: the derivation lowered to functions of
array statements (:mod:`codegen.lowering`), printed by the backend's printer, with what the
module states about itself (architecture, shapes, parameter order, what each function
stores)."""

from __future__ import annotations

import textwrap
from typing import Any

from ..derivations import sizes
from ..derivations.config import Config
from ..derivations.derivation import Derivation
from ..derivations.description import describe, structure
from ..derivations.program import Program
from . import runtime
from .lowering import lower

#: The codegen files every module backend's output depends on (its source hash).
MODULE_SOURCES = ("module.py", "lowering.py", "calls.py", "ir.py", "backends/array_printer.py",
                  "runtime.py")

#: What each kind of group computes, by the prefix of its name (``V``, ``W`` the variables).
_PURPOSES = (
    ("loss_hessian_rows_", "shared products of the diagonals on the rows rows_{0} selects"),
    ("loss_hessian_full_", "loss-Hessian block ({0}, {1}) whole"),
    ("loss_hessian_", "loss-Hessian block ({0}, {1}), Gauss–Newton and functional parts"),
    ("loss_tangent_rows_", "tangents along the rows rows_{0} selects of the loss nodes"),
    ("loss_tangent_", "tangents along {0} of the loss nodes"),
    ("tangent_rows_", "tangents along the rows rows_{0} selects of the network's nodes"),
    ("tangent_", "tangents along {0} of the network's nodes"),
    ("jacobian_", "the Jacobian ∂Z/∂{0}"),
    ("second_", "second derivatives ∂²Z/∂{0}∂{1}"),
    ("hvp_joint", "the Hessian-vector product along one direction in every variable"),
    ("per_sample_hvp_joint", "each sample's own Hessian-vector product in the parameters"),
    ("per_sample_gnvp_joint", "each sample's own Gauss–Newton-vector product in the "
     "parameters"),
    ("gnvp_joint", "the Gauss–Newton-vector product along one direction in every variable"),
    ("gnvp_params", "Gauss–Newton-vector products in the parameters"),
    ("kronecker_gauss_newton_", "the Kronecker factors of the Gauss–Newton block ({0}, {1})"),
    ("kronecker_functional_", "the Kronecker factors of the functional block ({0}, {1})"),
    ("kronecker_full_", "the Kronecker factors of the loss-Hessian block ({0}, {1})"),
    ("diagonal_gauss_newton_", "the diagonal of the Gauss–Newton block ({0}, {0})"),
    ("diagonal_functional_", "the diagonal of the functional block ({0}, {0})"),
    ("diagonal_rows_gauss_newton_", "the diagonal of the Gauss–Newton block ({0}, {0}) "
     "on the rows rows_{0} selects"),
    ("diagonal_rows_functional_", "the diagonal of the functional block ({0}, {0}) on the "
     "rows rows_{0} selects"),
    ("hvp_", "Hessian-vector products in {0}"),
    ("jvp", "the output's directional derivative along every variable"),
    ("gradient", "the loss gradient ∂ℓ/∂V of every variable"),
    ("per_sample_gradient", "each sample's own loss gradient ∂ℓ_b/∂V of every variable"),
    ("adjoints", "adjoints ∂ℓ/∂node of every node (reverse mode)"),
    ("loss_adjoints", "adjoints ∂ℓ/∂node of the loss's nodes and of Z (reverse mode)"),
    ("forward", "the forward pass"),
    ("loss", "the per-sample loss"),
)


def summary(der: Derivation, group: str, writes: list[str]) -> str:
    """A one-line docstring: what group ``group`` computes and the shapes it stores."""
    variables = sorted((v.name for v in der.variables), key=len, reverse=True)
    for prefix, purpose in _PURPOSES:
        if group.startswith(prefix):
            rest, names = group[len(prefix):], []
            while rest:
                name = next((v for v in variables if rest.startswith(v)), rest)
                names.append(name)
                rest = rest[len(name):].lstrip("_")
            text = purpose.format(*names, *[""] * 2)
            break

    def shape(name: str) -> str:
        tensor = der.graph.tensors[name]
        dims = ["B"] * tensor.batched + [str(s) for s in tensor.shape]
        return f"{name} ({', '.join(dims)})" if dims else f"{name} (scalar)"

    if not writes:
        return f"{text[0].upper()}{text[1:]}: zero, nothing to store."
    writes = sorted(writes, key=lambda n: der.graph.tensors[n].role != "output")  # results first
    shown = ", ".join(shape(n) for n in writes[:3])
    more = f" and {len(writes) - 3} more" if len(writes) > 3 else ""
    return f"{text[0].upper()}{text[1:]}: stores {shown}{more}."


def constant_dims(source: Config | Program) -> dict[str, int]:
    """The sizes the config fixes: heads ``h``, and with grouped-query attention the
    key/value heads ``g`` and the query heads ``r`` that share each; ``n_2 = 2`` for the
    halves a rotary pair spans (partial rotary: ``n_r = 2 / rotary_fraction`` chunks of a
    head, the first two turn); ``n_1 = 1`` for the one row a pooling keeps. A program fixes
    every size but those of ``X`` (and ``1``, the size of a dimension of one)."""
    if isinstance(source, Program):
        return {**source.constant_dims(), "1": 1}
    config = source
    dims = {"h": config.heads} if config.heads > 1 else {}
    if config.kv_heads:
        dims.update(g=config.kv_heads, r=config.heads // config.kv_heads)
    if config.rotary and config.rotary_fraction == 1:
        dims["n_2"] = 2
    elif config.rotary:
        dims["n_r"] = round(2 / config.rotary_fraction)
    if config.relative_bias:
        dims["n_u"] = config.relative_buckets
    if config.pooling != "none" or config.class_token:
        dims["n_1"] = 1
    return dims


def module_context(der: Derivation, backend: Any) -> dict[str, Any]:
    """Everything a module template needs: the printed functions and the contract's tables
    (which output node holds each Jacobian, Hessian block and HVP)."""
    tokens = isinstance(der.config, Program) and der.config.tokens
    printer = backend.printer({"one_hot_input": tokens})
    functions = lower(der)
    for function in functions:
        function.lines = [printer.statement(s) for s in function.statements]
    title, description = describe(der.config)
    if not (isinstance(der.config, Program) and der.config.scope == "products"):
        description += "\n\n" + textwrap.fill(structure(der.config, list(der.structured)), 88)
    external = der.external_shapes

    def shape(tensor) -> list[str]:
        """The shape callers pass (dimension names)."""
        return list(external.get(tensor.name, [str(s) for s in tensor.shape]))

    output_shape = list(external.get("Z", [str(s) for s in der.output.shape]))
    # per parameter, the shapes of the tangents its diagonal on rows holds per sample and row
    row_tangents: dict[str, list[list[str]]] = {}
    for function in functions:
        for prefix in ("tangent_rows_", "loss_tangent_rows_"):
            if function.group.startswith(prefix):
                shapes = row_tangents.setdefault(function.group[len(prefix):], [])
                for name in function.writes:  # those along the rows (the rest: fixed)
                    dims = [str(s) for s in der.graph.tensors[name].shape]
                    if str(sizes.R) in dims:
                        dims.remove(str(sizes.R))
                        shapes.append(dims)
    constants = [t for t in der.graph.tensors.values() if t.role == "constant"
                 and not any(a.target is t for a in der.graph.assigns)]
    return dict(
        title=title, description=description, config_name=der.config.name,
        summaries={f.group: summary(der, f.group, f.writes) for f in functions},
        backend=backend.name, loss=der.config.loss,
        scope=der.config.scope if isinstance(der.config, Program) else "all",
        params=[(p.name, shape(p)) for p in der.params],
        constants=[(c.name, shape(c)) for c in constants],
        batched_constants=[c.name for c in constants if c.batched],
        engine_shapes={name: [str(s) for s in der.graph.tensors[
            "T" if name == "Z" else name].shape] for name in external},
        constant_dims=constant_dims(der.config),
        input_shape=shape(der.X),
        output_shape=output_shape,
        target_shape=output_shape[:-1] if der.config.loss == "cross_entropy" else output_shape,
        variables=[v.name for v in der.variables],
        jacobian=der.nodes("jacobian"), output_hessian=der.nodes("output_hessian"),
        loss_hessian=der.nodes("loss_hessian", ("gauss_newton", "functional")),
        loss_hessian_full=der.nodes("loss_hessian"), gradient=der.nodes("gradient"),
        per_sample_gradient=der.nodes("per_sample_gradient"),
        hvp=der.nodes("hvp"),
        directions=der.nodes("hvp", key="direction"),
        jvp=der.nodes("jvp")[()], joint_hvp=der.nodes("hvp_joint"),
        per_sample_joint_hvp=der.nodes("per_sample_hvp_joint"),
        per_sample_joint_gnvp=der.nodes("per_sample_gnvp_joint"),
        joint_gradient=der.nodes("joint_gradient").get("X", ""),
        input_varies=der.input_varies,
        joint_directions=der.nodes("hvp_joint", key="direction"),
        diagonal=der.nodes("diagonal", ("gauss_newton", "functional")),
        diagonal_rows=der.nodes("diagonal_rows", ("gauss_newton", "functional")),
        row_directions=der.nodes("diagonal_rows", key="direction", parts=(
            "gauss_newton",)),
        row_tangents=row_tangents,
        joint_gnvp=der.nodes("gnvp_joint"), gnvp=der.nodes("gnvp_params"),
        kronecker=der.structured,
        functions=functions, output=der.output.name,
        loss_node=der.loss.name,
        # the runtime, copied from runtime/: the array primitives before the groups, the
        # rest after them
        api=runtime.api_text(),
        runtime_arrays=runtime.text([runtime.arrays(backend.name)]),
        runtime=runtime.text(runtime.after_arrays(constant_dims(der.config))))
