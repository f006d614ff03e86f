"""Directory (control plane): what exists and where replicas live. Never touches KV bytes."""
