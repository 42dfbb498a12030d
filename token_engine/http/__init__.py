"""The HTTP shell: vLLM's `/inference/v1/generate`, abort, health, metrics, its msgspec wire structs and their
validation into sampling options (`request_error.py`: what a refused request raises)."""
