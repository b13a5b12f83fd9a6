"""Compatibility shims (see docs/design.md)."""
