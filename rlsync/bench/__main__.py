"""`python -m rlsync.bench [overrides]`: the update or the offload alone (rlsync.bench.runner)."""

from rlsync.bench.runner import main

if __name__ == "__main__":
    main()
