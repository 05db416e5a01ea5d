"""A job's lifecycle: its state machine (job.py), the policy that maps a
fault to a decision, the response that carries it out, and drill overlays."""
