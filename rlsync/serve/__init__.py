"""The standalone engine: `python -m rlsync.serve` builds an engine and serves trainers over HTTP."""
