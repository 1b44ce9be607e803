"""The ranks of one node: how they start and stop (``pcontext.py``), where their output goes
(``relay.py``), what each rank runs under (``_bootstrap.py``), and torch's error files they
leave behind. Importing this package imports nothing."""
