"""The host process: the daemon and its systemd side, the supervisor loop over
every job, adoption after a restart, and the control socket with its access rule."""
