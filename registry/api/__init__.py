"""The farm's HTTP API (FastAPI); see ``registry.api.app.create_app``."""

from registry.api.app import create_app

__all__ = ["create_app"]
