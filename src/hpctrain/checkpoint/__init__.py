"""Sharded checkpoints: DCP shards per rank, an atomic commit with a verified manifest, resume."""
