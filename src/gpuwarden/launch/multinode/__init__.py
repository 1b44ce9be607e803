"""Several nodes: the preflight and the join (``rendezvous.py``), the node agent that runs
torch's c10d rendezvous (``node_agent.py``, ``_node_agent.py``), one first failure and one
decision for the whole job (``job_store.py``), Slurm's variables, and the ranks' side of the
workers' store (``_store_watch.py``, ``_store_stacks.py``). Imported only by a launch of several
nodes (and by a rank of one). Importing this package imports nothing."""
