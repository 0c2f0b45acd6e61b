"""The PyTorch backend: modules that take and return torch tensors on their device (float64
or float32; float16 and bfloat16 are computed in float32 and returned in their own dtype)."""

from ... import runtime
from ...module import MODULE_SOURCES, module_context
from ..backend import Backend
from .printer import TorchPrinter

BACKEND = Backend(
    name="torch", printer=TorchPrinter, context=module_context,
    template="module.py.jinja", templates=("torch", "common"),
    sources=(*MODULE_SOURCES, "backends/torch"), runtime=runtime.sources("torch"),
    array_module="torch", from_torch=lambda tensor: tensor,
)
