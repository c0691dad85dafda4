"""Cluster: router, coordinator, Redis-backed state (built by a later issue)."""
