"""The embedded default: a bundled trainer and a drill that breaks it on purpose."""
