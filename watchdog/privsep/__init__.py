"""Privilege separation: root never acts on a job user's files with its own rights.

The daemon runs as root; a job's folders (checkpoints, dumps, the ring folder)
are its user's to write. Everything trainwatch does there (listing, judging a
layout, hashing, deleting, the snapshot store's GC, pulls, copying dumps) runs
in the job's *hand* (hand.py): a process forked from the daemon that has
dropped to the job's uid, gid and groups, so that the kernel's own permission
checks apply. Root sends it a call (a function of ours and its arguments,
pickled: root's data, read by the unprivileged side) and reads back only JSON
and raw bytes, size-capped and with a deadline: a file whose read blocks, or a
folder of a million names, costs that job's verdict, never the host's loop.
Root's own folders take only bounded copies of what comes back.

As OpenSSH's privsep, reversed: here the privileged side drives, and the
unprivileged side does the parsing of what a user wrote.
"""
