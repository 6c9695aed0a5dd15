"""`python -m rlsync.serve [overrides]`: an engine on its own (rlsync.serve.server)."""

from rlsync.serve.server import main

if __name__ == "__main__":
    main()
