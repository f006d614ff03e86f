"""Storage workers: membership, control calls, page credit and reclaiming pages."""
