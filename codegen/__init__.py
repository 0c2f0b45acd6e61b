"""Lowering of derived expressions to numpy and PyTorch code, and the CLI."""
