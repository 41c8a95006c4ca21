"""The one error type the command line turns into a one-line message and exit status 2."""


class DumpError(Exception):
    """A problem the user can fix: a bad flag, checkpoint or hub snapshot (a destination's problem is a
    `kda_spec.storage.StorageError`)."""
