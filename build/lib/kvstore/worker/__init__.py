"""Storage worker (data plane): owns tier memory, never decides policy."""
