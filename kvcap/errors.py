"""The one exception type for bad user input: the CLI prints its message on one line and exits 2."""


class InputError(ValueError):
    """Bad input from the user (flags, files, names, units). Never a bug in kvcap."""


class RefusedComparison(Exception):
    """`compare` refuses two runs whose fixed variables differ (exit code 3)."""


class EndpointError(Exception):
    """The endpoint cannot serve the run (unreachable, or not serving the model asked for): one line, exit 1.

    Not bad input (exit 2): the flags may be right and the server down; 1 is the contract's "anything else"."""
