"""Who am I: launcher detection, run directory, provenance and per-rank logging."""
