"""``python -m loadgen.cli``: the ``bench`` command."""

from loadgen.cli.app import main

main()
