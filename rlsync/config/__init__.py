"""The config: the typed schema and its key rules, the one validation pass, the launch environment."""
