"""Errors the lowest layers raise, with no imports of their own."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or config is one multilora does not implement."""
