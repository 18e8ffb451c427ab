"""The `asyncengine` command line."""
