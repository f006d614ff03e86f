"""Values shared by every layer: keys, specs, errors, sizes. No I/O here."""
