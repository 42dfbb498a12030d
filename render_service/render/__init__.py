"""Request -> engine request: the per-process configuration (`render_config.py`), chat and completion render
(`render.py`) over a chat request's template inputs and prompt encoding (`chat_prompt.py`, shared with
`extend/`), `tool_choice` and structural tags, `response_format` as a constraint, prerendered ids, the
configuration's fingerprint, and the reference switch that turns every render acceleration off
(`reference_mode.py`)."""
