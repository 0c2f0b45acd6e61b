"""Jinja templates: ``common/`` structure shared by the backends, one folder per backend."""
