"""Where the toolkit's resources live: the shipped configs, the templates, the generated files."""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = PACKAGE_ROOT / "configs"
MODEL_CONFIGS = CONFIGS / "models"
TEMPLATES = PACKAGE_ROOT / "templates"
RUNTIME = PACKAGE_ROOT / "runtime"
GENERATED = PACKAGE_ROOT / "generated"


def shipped_configs() -> list[Path]:
    """The config files shipped in ``configs/``, by name."""
    return sorted(CONFIGS.glob("*.toml"))
