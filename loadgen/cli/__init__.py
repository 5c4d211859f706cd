"""The ``bench`` command line: the app, each command's options, printing and exit codes."""
