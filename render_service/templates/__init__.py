"""Chat templates as Hugging Face renders them: `chat_template.py` over the Jinja sandbox (`sandbox.py`, with
`inline.py` and `tojson_cache.py`), its budgets (`budget.py`), content-format analysis, messages and tools prepared
for a template (`chat_messages.py`)."""
