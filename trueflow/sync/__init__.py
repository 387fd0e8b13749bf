"""Weight sync between trainer and engine: checksums, buckets, IPC transport."""
