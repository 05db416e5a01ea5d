"""Acting through Slurm (DESIGN.md "Jobs across hosts"; prior art in
prior-art/multinode.md section 3): the only code of the daemon that runs
Slurm's commands.

- ``command``: running one Slurm command (an argv, never a shell; a deadline;
  the environment from ``Slurm``) and judging its exit into one ``Result``:
  ok, refused (with Slurm's reason) or failed (no usable answer).
- ``parse``: pure functions: the checks of what goes into a command (job ids,
  node names, the ``trainwatch: `` drain reason), the parsers of what comes out
  (``scontrol listpids``, ``scontrol show job -o``, ``sinfo``), and the rules
  (when a requeued job may be started, whose drain may be resumed).
- ``actions``: what the daemon asks of Slurm: ``requeue`` a job and start it at
  once, ``drain`` a node, ``resume_if_ours``, ``listpids``, ``restart_count``.
- ``proof``: ``prove`` a rank's claim (job, step, rank) before it is believed:
  the peer's SO_PEERCRED, its ancestors in ``/proc``, the job's owner and state,
  and ``scontrol listpids`` on this node.
- ``register``: proofs off the loop, each rank answered "pending" until its own
  is in; ``attach``: the ``attach`` op, the job's runner (``slurm-<J>``) made
  or found and the rank taken into its run.
- ``step``, ``stepattempt``: a run of the job on this node (its proven tasks,
  never signalled; its end as Slurm judged it).
- ``requeue``: recovery through Slurm (the decision where every node resumes,
  the requeue and its outcome); ``node``: this node drained for a GPU, resumed
  after a pre-flight, only from trainwatch's own drain.
"""
