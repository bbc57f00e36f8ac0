"""Files other processes read, written whole or not at all (``durable.atomic``).

Below both ``orchestrator`` and ``sharding``: the data layer stands alone (a user can take
``sharding`` without the rest), and both write through the same temp-file, fsync, rename.
Standard library only.
"""
