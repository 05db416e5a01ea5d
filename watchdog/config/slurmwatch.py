"""The ``slurm:`` section: this daemon also watches the Slurm jobs whose ranks
attach to it (slurm/attach.py), each with the settings of ``slurm.job``, a job
entry without a name or a command (Slurm launches it, trainwatch never does).

    slurm:
      node: n1          # Slurm's name for this node; default: the host's name
      conf: /etc/slurm/slurm.conf   # SLURM_CONF for scontrol; default: Slurm's own
      timeout: 15s      # for each Slurm command
      forget_after: 10m # an attached job that ended is dropped then (its incidents stay)
      job:              # what every attached job gets: policy, heartbeat, stall, ...
        policy: default
        heartbeat: {timeout: 5m}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainwatch.config import fields
from trainwatch.config.reader import DUR, STR, Reader
from trainwatch.config.schema import Job, SlurmWatch

# What an attached job's template may set: not a command, a user, an
# environment or nodes (Slurm's, and the proven owner's), nor a name.
TEMPLATE_KEYS = {"checkpoints", "heartbeat", "policy", "anomalies", "logs", "stall",
                 "evidence", "gpus"}
COMMAND = ("slurm",)  # an attached job's placeholder command: never run


def read(r: Reader, raw: object, host: str,
         job: Callable[[Mapping[str, Any]], Job]) -> SlurmWatch | None:
    """None when the section is absent. ``job`` reads a job entry (read.py's)."""
    if raw is None:
        return None
    m = r.mapping(raw, "slurm", {"node", "job", "conf", "timeout", "forget_after"})
    node = r.get(m, "node", "slurm", fields.HOST, None) or host
    t = r.mapping(m.get("job"), "slurm.job", TEMPLATE_KEYS)
    return SlurmWatch(node=node, job=job({"name": "slurm", "command": list(COMMAND), **t}),
                      conf=r.get(m, "conf", "slurm", STR, None),
                      timeout=r.get(m, "timeout", "slurm", DUR, SlurmWatch.timeout),
                      forget_after=r.get(m, "forget_after", "slurm", DUR,
                                         SlurmWatch.forget_after))
