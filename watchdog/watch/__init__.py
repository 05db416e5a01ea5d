"""A job's watchers: each turns what a source saw (beats, output, exits, GPU
samples) into what the detectors judge, and their faults into the job's response."""
