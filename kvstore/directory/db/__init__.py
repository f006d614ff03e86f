"""SQL: the engine, the one writer, the in-memory index, shared queries, models and migrations."""
