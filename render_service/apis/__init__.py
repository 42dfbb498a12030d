"""The Responses and Anthropic Messages surfaces over the one render/derender pipeline.

Each API maps its request onto a chat request (``responses.py``, ``messages.py``) that ``render.render_chat``
renders, and assembles its output (items, content blocks, event sequences) from the ordered segments the shared
parser pipeline produces (``segments.py``). Protocol structs live beside each API.
"""
