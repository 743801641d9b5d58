"""The elected leader's process: its loop, intake, the pass's reads, delivery, prefetch."""
