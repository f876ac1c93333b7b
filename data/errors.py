"""The one exception type the data package raises for bad input."""


class DataError(ValueError):
    """Bad or missing data. The message is one line: what is wrong and how to fix it.

    A ValueError subclass so callers that already catch ValueError keep working; cli.py
    prints the message without a traceback.
    """
