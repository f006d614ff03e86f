"""Lookups and loads: what is stored, pinned under a lease, promoted when needed."""
