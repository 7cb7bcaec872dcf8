"""``python -m hpctrain`` is the ``hpctrain`` command."""

from hpctrain.cli import main

if __name__ == "__main__":
    main()
