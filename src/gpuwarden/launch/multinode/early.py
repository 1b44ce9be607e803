"""The node agent started before the CLI parses its command line.

``gpuwarden launch`` of several nodes starts its node agent first thing: the agent's torch
import (the longest step before any rank starts) then overlaps the CLI's own start-up. Whether
a command line spans several nodes is guessed here without parsing it, and without importing
the agent's module unless it does: a launch of one node pays nothing for this.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwarden.launch.multinode.node_agent import NodeAgent

_early: NodeAgent | None = None  # started by start_early, not taken yet


def looks_multinode(argv: list[str], env: dict[str, str] | os._Environ[str]) -> bool:
    """A cheap guess, before any parsing, that ``gpuwarden launch ARGV`` spans several nodes:
    --nnodes N or MIN:MAX with more than one node, or a multi-node Slurm step without
    --nnodes. Only a head start: the launch confirms it (a wrong guess costs one idle agent)."""
    if not argv or argv[0] != "launch" or "--standalone" in argv:
        return False
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--nnodes=") else \
            argv[i + 1] if arg == "--nnodes" and i + 1 < len(argv) else None
        if value is not None:
            most = value.rpartition(":")[2].strip()
            return most.isdigit() and int(most) > 1
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or ""
    return "SLURM_STEP_ID" in env and nodes.isdigit() and int(nodes) > 1


def start_early(argv: list[str]) -> None:
    """Start the node agent now when the command line looks multi-node: its torch import (the
    longest step before any rank starts) then overlaps the CLI's own start-up."""
    global _early
    if _early is None and looks_multinode(argv, os.environ):
        from gpuwarden.launch.multinode.node_agent import NodeAgent

        try:
            _early = NodeAgent.start()
        except OSError:
            _early = None


def take_early() -> NodeAgent | None:
    """The agent started early, now the launch's to use and end."""
    global _early
    agent, _early = _early, None
    return agent


def discard_early() -> None:
    """An early agent nobody took (a usage error, a single-node launch after all): end it."""
    agent = take_early()
    if agent is not None:
        agent.close()
