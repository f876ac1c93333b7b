"""The one exception type the data package raises for bad input."""


class DataError(ValueError):
    """Bad or missing data. The message is one line: what is wrong and how to fix it.

    A ValueError subclass so callers that already catch ValueError keep working; cli.py
    prints the message without a traceback.
    """


def checked_index(i, n, what, where=""):
    """Index `i` of `n` items as a non-negative int (negative ones count from the end), or an
    IndexError naming the kind of item, as every dataset's __getitem__ must give."""
    if not -n <= i < n:
        raise IndexError(f"{what} {i} out of range for {n} {what}s{where}")
    return int(i) % n
