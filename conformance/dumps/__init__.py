"""The dump sets: reading and checking them (format v1), and the npz loader that never unpickles."""
