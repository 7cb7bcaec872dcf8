"""hpctrain: PyTorch training from one GPU to a Slurm cluster, fast, restartable, measurable."""

__version__ = "0.1.0"
