"""Planning: what a trial needs and how it is laid out, from compiled programs.

The memory model and its compiles (`memory`), sharding rules (`sharding`), the
training step (`train_step`), the planner (`planner`: `plan_mesh`) and its cache
(`plan_cache`), evaluation chunking (`evaluation`) and fused groups (`fusion`).
"""
