"""The wire structs (`protocol.py`, msgspec) and the request decode: chat messages and tools remembered by their
JSON bytes (`message_memo.py`, `body_prefix_store.py`)."""
