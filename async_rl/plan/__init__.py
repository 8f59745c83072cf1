"""Capacity planning: the hardware table, the cost model, and the search over placements.

`plan.hardware` states what each accelerator kind can do, `plan.costs` turns a model's
shapes into times and bytes, and `plan.search` simulates placements of a workload on
a cluster with those costs (`async_rl.sim`). `python -m async_rl.launch.plan` is the
command.
"""
