"""The shipped configs (TOML data)."""
