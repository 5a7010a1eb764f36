"""What several benchmarks share: the plain-text table, the spread of repeated timings, the
meters (live bytes, per-layer collectives and saved activations), rotating timing rounds and
the small GPT-2 trial. A benchmark imports from here, never another benchmark's privates."""
