"""Errors meant for the user: the CLI prints their message on one line, without a traceback."""


class RfedrayError(Exception):
    """A problem the user can fix (bad input, unusable environment); exit status 2 in the CLI."""

    exit_code = 2
