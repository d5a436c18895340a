"""`ragcache bench`: workload generation, the side-by-side run, the report and the policy replay.

Not on the runtime path: nothing in the engine imports this package.
"""
