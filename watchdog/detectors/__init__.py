"""Detectors: small pure functions from observations to a Fault (or None). No I/O."""
