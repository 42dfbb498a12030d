"""What RL trainers drive on the engine: pause/resume, abort, live weight updates, checksums (vLLM's dev routes)."""
