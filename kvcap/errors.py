"""The one exception type for bad user input: the CLI prints its message on one line and exits 2."""


class InputError(ValueError):
    """Bad input from the user (flags, files, names, units). Never a bug in kvcap."""


class RefusedComparison(Exception):
    """`compare` refuses two runs whose fixed variables differ (exit code 3)."""
