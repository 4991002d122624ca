"""The one exception type for bad user input, shared by every entry script."""


class InputError(ValueError):
    """A bad variable, argument or input file.

    The message is one line naming what was given, the value and what is expected.
    Entry scripts print it without a traceback and exit with status 2.
    """
