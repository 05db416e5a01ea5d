"""Jobs that span hosts: one daemon per host runs the same job entry, each
launching its own torchrun agent, and torchrun's c10d rendezvous carries the
group restart (DESIGN.md "Jobs across hosts"; prior art in multinode.md).

- ``torchrun``: the launch contract, what trainwatch adds to a job's torchrun
  command and environment so that trainwatch's budget, not torchrun's, ends a
  job and a host can rejoin a running group.
"""
