"""``python -m gpuwarden``: the CLI with this interpreter (the examples use it, so the command
they show runs with the same Python and gpuwarden as the script that shows it)."""

from gpuwarden.cli import console_main

console_main()
