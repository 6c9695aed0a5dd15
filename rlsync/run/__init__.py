"""A run: the step loop (loop.py), and the check before it that it fits in memory (memory_check.py)."""
