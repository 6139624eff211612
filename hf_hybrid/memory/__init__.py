"""Where the hybrid's state lives and what it costs: bit-exact snapshots (`snapshot.py`), pinned host buffers
(`host_buffers.py`), where the rollback copies go (`placement.py`), each rank's shard of a parameter (`shards.py`),
host memory against the machine (`host_memory.py`) and GPU memory (`vram.py`)."""
