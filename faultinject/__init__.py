"""Drills: inject faults into a job that trainwatch supervises, through the
job's real processes, to prove the whole detect-and-recover path."""
