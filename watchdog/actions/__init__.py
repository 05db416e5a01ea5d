"""Actions: what the supervisor does to a job's processes (launch, stop, exec hook)."""
