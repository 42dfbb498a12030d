"""Model directories as both tiers see them (`model_bundle.py`), the built-in default bundle and the chat templates
we ship."""
