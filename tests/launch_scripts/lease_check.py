"""Print the leases held while this rank runs (the launcher must hold one for the job's GPUs)."""
from gpuwarden.lease import list_leases

table = list_leases()
for record in table.holders:
    print("LEASE", record.pid, ",".join(sorted(c.uuid[-1] for c in record.claims)))
