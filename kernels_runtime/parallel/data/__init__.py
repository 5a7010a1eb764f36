"""Data parallelism: DDP and ZeRO-1/2 on flat buckets (own code), ZeRO-3 on FSDP2.

``applier.py`` is the entry point ``parallelize`` calls; ``zero.py`` / ``zero_comms.py`` and
``fsdp.py`` / ``fsdp_comms.py`` are each strategy's algorithm and its collectives."""
