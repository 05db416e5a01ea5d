"""The local recovery engine: the job's own process tree on this host."""
