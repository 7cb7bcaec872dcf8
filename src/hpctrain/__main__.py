"""``python -m hpctrain`` is the ``hpctrain`` command."""

from hpctrain.runtime import early_signals

# Before the imports below, which take seconds (torch): see early_signals.
early_signals.install()

from hpctrain.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
