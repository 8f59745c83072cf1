"""The shipped experiments: each module's `get_config()` returns the ConfigDict of one.

The binaries load them as files (`--config=configs/tiny.py` in a clone of the
repository, where `configs/` links here).
"""
