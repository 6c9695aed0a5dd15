"""rlsync: what keeping a rollout engine in sync with its trainer costs, measured against the copy floor.

Entry points: `python -m rlsync` (runs and sweeps: experiment.py is the step loop),
`python -m rlsync.bench` (the update or the offload alone), `python -m rlsync.report` (many runs
into one comparison), `python -m rlsync.engine` (an engine on its own, joined over TCP).
The weight update lives in sync/, the trainer's offload in offload.py, the floors in limits.py.
"""
