"""The observer side: what ``gpuwarden status`` and ``gpuwarden stacks`` reach. The launcher's
control endpoint and the per-user registry (``control.py``), and the answers it gives
(``observe.py``). Importing this package imports nothing."""
