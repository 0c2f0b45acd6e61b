"""Generated modules (do not edit by hand): ``numpy/`` and ``torch/`` backends."""
