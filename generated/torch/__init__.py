"""Generated PyTorch modules, one per config."""
