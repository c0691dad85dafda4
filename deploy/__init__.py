"""Frontends, CLI and tools."""
