"""rlsync: what keeping a rollout engine in sync with its trainer costs, measured against the copy floor.

One package per part, each importing only those below it (pyproject.toml's layers contract):
report; plan | serve; bench | run; record; trainer; sync; engines; model; measure; config; the base
(errors, registry, fmt). `python -m rlsync` is a run (run/loop.py is the step loop); the weight
update is update/, the trainer's offload trainer/offload.py, the copy floors measure/floors.py.
"""
