"""Exact multi-turn tokens: a render that extends the token stream a model really sampled.

An RL trainer (or an agent loop) sends the previous turn's prompt ids and the completion ids the engine sampled
with the conversation as it now stands. ``bridge`` finds what the chat template writes after that assistant turn
(its close and the new messages), proves where it starts, and appends only that to the sampled ids; ``turns``
attributes every token to a message (loss masks); ``chat`` ties both to a chat render. docs/rl.md describes the
request and answer.
"""
