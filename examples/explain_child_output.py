"""Diagnose a failed child process from its output, the way gpuwarden launch does.

Runs a command, feeds its merged stdout/stderr to an ``Explainer`` line by line as
it arrives (memory stays bounded however long the job runs), and prints the
diagnosis when the command fails:

    python examples/explain_child_output.py -- python -c "import torch; torch.zeros(1).cuda()"
"""

from __future__ import annotations

import subprocess
import sys

from gpuwarden.explain import Explainer, load_knowledge


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    explainer = Explainer(load_knowledge(), source="child")
    with subprocess.Popen(argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            sys.stdout.buffer.write(raw)
            explainer.feed_bytes(raw)
    if proc.returncode == 0:
        return 0
    diag = explainer.result()
    p = diag.primary
    print(f"\nexit code {proc.returncode}: {p.code} ({p.title})", file=sys.stderr)
    print(f"  why: {p.why}\n  fix: {p.fix}", file=sys.stderr)
    for line, text in p.evidence:
        print(f"  evidence: line {line}: {text}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
