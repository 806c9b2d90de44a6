"""pytest fixtures for closbox fabrics (see README.md)."""

from .plugin import Fabric, ClosboxError

__all__ = ["Fabric", "ClosboxError"]
