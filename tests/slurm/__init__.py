"""Tests against a real single-node Slurm cluster (see conftest.py)."""
