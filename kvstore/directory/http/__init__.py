"""The HTTP face: routes, the hot path, credentials."""
