"""The framework maps: what each RL framework's logged keys mean (base.py; one module per framework)."""
