"""What trainwatch shows: Prometheus metrics and the published status files."""
