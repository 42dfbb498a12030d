"""Text <-> token ids: `tokenizer.py` over tokenizers, with the fastokens and tiktoken fast paths proven equal at
load; prompt ids through the piece cache (`incremental_tokenizer.py`) and the store of recent prompts
(`prompt_prefix_store.py`, `head_index.py`)."""
