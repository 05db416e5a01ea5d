"""Sources turn the outside world into typed observations; they know nothing of policy."""
