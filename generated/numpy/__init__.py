"""Generated numpy modules, one per config."""
