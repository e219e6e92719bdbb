"""The error a server that cannot start raises: a leaf, imported by whatever checks a part of
the start (the pool, the token and certificate loaders, the listeners)."""


class StartError(RuntimeError):
    """The server cannot start: a dataset does not open, a port is taken. The message says
    which, in one line."""
