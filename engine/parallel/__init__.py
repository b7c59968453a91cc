"""Tensor parallelism: a rank's shard of the model and its collectives (shard, shm_all_reduce), and the start of a
replica's rank processes (ranks). What a rank runs is given to it (the runner class), so this room imports no runner.

Nothing is re-exported here: import the module that owns a name.
"""
