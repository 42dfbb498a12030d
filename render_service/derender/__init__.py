"""Token ids -> OpenAI responses: batch (`batch.py`) and streaming (`stream.py`, one chunk a call), the message and
delta shapes the gateway shares (`choice_shapes.py`), logprobs."""
