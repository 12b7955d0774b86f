"""Models the project builds itself (no model hub is reachable here)."""
