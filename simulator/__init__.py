"""kvplan's simulator: SimPy replays of request traces through the engine's own Scheduler and
BlockManager, with step times from a latency model (fitted on engine step records, or a roofline).

Imports no torch. Start at `simulator.run.run_simulation`, or `kvplan simulate` on the command line.
"""
