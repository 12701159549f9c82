"""Network impairment for tests and benchmarks: a user-space UDP proxy (loss, delay,
jitter, reordering) for machines whose kernel offers no netem."""
