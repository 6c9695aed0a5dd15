"""The benchmark: `python -m rlsync.bench` times the update (or the offload) alone."""
