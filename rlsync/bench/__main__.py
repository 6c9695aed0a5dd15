"""`python -m rlsync.bench [overrides]`: the update or the offload alone (rlsync.bench.runner)."""

from rlsync.errors import signals_from_here

with signals_from_here():  # the stop signals from the first line: one during the imports (torch) is one line
    from rlsync.bench.runner import main

if __name__ == "__main__":
    main()
