"""Data parallelism: DDP and ZeRO-1/2 on flat buckets (own code), ZeRO-3 on FSDP2."""
