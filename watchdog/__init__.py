"""trainwatch: a self-healing watchdog for long GPU training runs."""

__version__ = "0.1.0"
