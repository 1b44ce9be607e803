"""What the launcher sees of its ranks from outside, while they run: each rank's phase record
(``status.py``, written by the bootstrap), its stacks and CPU time (``sampler.py``), the PURE
stall and straggler decisions over them, NCCL's flight recorder, ranks on another rank's GPU.
Importing this package imports nothing."""
