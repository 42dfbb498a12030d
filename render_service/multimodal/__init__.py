"""Images through the render tier: where an image part comes from (``sources``), how large it may be before it
is decoded (``bounds``), which model families we can count placeholders for (``families``, ``qwen_vl``), the
content hashes vLLM keys its caches on (``hashing``), the worker-process pool that decodes and patchifies
(``pool``), and the ``features`` a tokens-only engine or a router reads (``features``, ``chat``)."""
