"""Measuring a run: per-rank metrics, accelerator peaks and MFU, progress display."""
