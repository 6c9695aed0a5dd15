"""A run: the step loop (loop.py) and how each rank takes part in its phases (roles.py)."""
