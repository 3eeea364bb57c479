"""The base class of flint's errors: ``except FlintError`` catches any error flint raises on purpose.

Each error class also derives from the builtin it always was (ValueError, RuntimeError, ...), so callers
that catch those keep working.
"""
from __future__ import annotations


class FlintError(Exception):
    """An error flint raises on purpose, with a message meant for the user."""
