"""hpctrain: PyTorch training from one GPU to a Slurm cluster, fast, restartable, measurable."""

__version__ = "0.1.0"


def fit(*args, **kwargs):
    """Train a user's own task from Python (see :func:`hpctrain.fitting.fit`)."""
    from hpctrain.fitting import fit as _fit  # torch loads on first use, not on import

    return _fit(*args, **kwargs)
