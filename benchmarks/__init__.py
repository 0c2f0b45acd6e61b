"""Benchmarks: generated modules against torch.func and curvlinops, in one process."""
