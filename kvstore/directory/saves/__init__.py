"""Saves: placement, reservations, the commit that makes blocks visible."""
