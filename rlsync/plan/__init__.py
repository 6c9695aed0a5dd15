"""The planner: `python -m rlsync.plan model=... update.*=...` prints and writes (plan.json) the update's
bucket plan and its predicted time, from the config and a calibration file, without allocating a
weight. rlsync/plan/cost.py is the cost model and its fit, calibrate.py the calibration runs, collective.py
the all-gather probe, profiles.py the calibration files, planner.py the plan, ranks.py its data-parallel part,
flags.py its flags, render.py the printed plan, compare.py plan against benchmark.
"""
