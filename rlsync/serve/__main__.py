"""`python -m rlsync.serve [overrides]`: an engine on its own (rlsync.serve.server)."""

from rlsync.errors import signals_from_here

with signals_from_here():  # the stop signals from the first line: one during the imports (torch, uvicorn) is one line
    from rlsync.serve.server import main

if __name__ == "__main__":
    main()
