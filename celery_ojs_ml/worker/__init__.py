"""The worker's main process: bootsteps, the dispatch gate, leases, preemption, control."""
