"""``--max-restarts``: the PURE restart policy (``policy.py``) and the attempt loop that applies
it (``attempts.py``). Importing this package imports nothing."""
