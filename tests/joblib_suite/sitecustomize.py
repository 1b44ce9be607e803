"""Imports gpuwarden in the Python children that joblib's tests start with ``python -c``.

A user's script selects backend="gpuwarden" after ``import gpuwarden`` (joblib has no
entry points for backends); joblib's test scripts are written for its built-in backends,
so this stands in for that one import line.
"""

import gpuwarden  # noqa: F401
