"""The numpy backend: modules that take and return numpy arrays (float64 or float32; float16
is computed in float32 and returned in float16)."""

from ... import runtime
from ...module import MODULE_SOURCES, module_context
from ..backend import Backend
from .printer import NumpyPrinter

BACKEND = Backend(
    name="numpy", printer=NumpyPrinter, context=module_context,
    template="module.py.jinja", templates=("numpy", "common"),
    sources=(*MODULE_SOURCES, "backends/numpy"), runtime=runtime.sources("numpy"),
    array_module="numpy", from_torch=lambda tensor: tensor.numpy(),
)
