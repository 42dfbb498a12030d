"""The render configuration: everything render and derender need, built once per process from a model
bundle and the server's flags (``load_render_config`` / ``build_render_config``), plus the per-request rules
both read off it (the served model name, the chat template kwargs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from render_service.caches.budget import CacheBudget, CacheShares
from render_service.http.errors import bad_request, model_not_found
from render_service.templates.budget import DEFAULT_RENDER_SECONDS
from render_service.templates.chat_template import ChatTemplate
from render_service.tokenize.tokenizer import RenderTokenizer, TextTokenizer
from render_service.wire.message_memo import MessageMemo
from render_service.wire.protocol import ChatCompletionRequest
from splitserve_common.block_hashes import BlockHashConfig

if TYPE_CHECKING:
    from render_service.bundle.model_bundle import ModelBundle

# vLLM's VLLM_MAX_N_SEQUENCES default.
MAX_N = 16384
# generation_config.json keys vLLM takes as sampling defaults (max_new_tokens becomes max_tokens).
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# --reasoning-field: the key(s) chat responses carry reasoning under (vLLM renamed it in 0.11).
REASONING_FIELDS = ("reasoning", "reasoning_content", "both")
# vLLM's --tool-strict-level, lowest first.
TOOL_STRICT_LEVELS = ("auto", "function", "parameter")


def reasoning_keys(field: str) -> tuple[str, ...]:
    """The response key(s) reasoning text goes under for a --reasoning-field value."""
    return ("reasoning", "reasoning_content") if field == "both" else (field,)


@dataclass
class RenderConfig:
    """Everything render and derender need, built once per process."""

    bundle: ModelBundle
    served_model_names: list[str]
    template: ChatTemplate | None
    fingerprint: str
    # The bundle's template named "tool_use", used for requests with tools (HF's get_chat_template, vLLM); None
    # without one, or when --chat-template replaced the bundle's templates.
    tool_template: ChatTemplate | None = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    trust_request_chat_template: bool = False
    max_model_len: int = 0
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    template_special_tokens: dict[str, str] = field(default_factory=dict)
    reasoning_parser_cls: Any = None
    # Output shape only (not in the fingerprint): the chat reasoning key(s), and vLLM's "token_id:N" logprobs.
    reasoning_field: str = "reasoning"
    return_tokens_as_token_ids: bool = False
    # gpt-oss: prompts are Harmony (render_service/harmony/), not a chat template
    harmony: bool = False
    # Prompt text -> ids through the per-process piece cache (tokenize/incremental_tokenizer.py); None: the tokenizer's.
    prompt_encoder: Any = None
    # Chat messages and tools decoded and prepared once per distinct JSON (wire/message_memo.py); None: off
    message_memo: MessageMemo | None = None
    # Masked answers' attributions, for the next turn's extend (extend/attributions.py); None: off
    attributions: Any = None
    # Prompts kept under the prompt_ref their answer carries, for the next turn's extend (extend/prompt_refs.py)
    prompt_refs: Any = None
    # --render-cache-bytes split between the caches, and their counters for /metrics (caches/budget.py)
    caches: CacheBudget | None = None
    # vLLM's --tool-strict-level: how far render constrains tool calls (render_service/render/tool_choice.py)
    tool_strict_level: str = "auto"
    # CPU time of one chat-template render (--chat-template-timeout; template_budget)
    chat_template_timeout_s: float = DEFAULT_RENDER_SECONDS
    # The engines' block size and vLLM's --prefix-caching-hash-algo, for block hashes a render request asks for
    block_hash_config: BlockHashConfig = field(default_factory=BlockHashConfig)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> RenderTokenizer:
        return self.bundle.tokenizer

    @property
    def has_parsers(self) -> bool:
        return bool(self.reasoning_parser or self.tool_call_parser)

    @cached_property  # read on every streamed chunk; the bundle does not change after the config is built
    def output_vocab_size(self) -> int:
        """Token ids an engine may send back: the model's vocab_size (config.json), which is often larger than
        the tokenizer's (Qwen3: 151936 rows, 151669 tokens). Ids in between decode to nothing, as in vLLM."""
        return max(self.tokenizer.vocab_size, model_vocab_size(getattr(self.bundle, "config", None)))


def model_vocab_size(config: Any) -> int:
    """config.json's vocab_size (or its text_config's, for multimodal configs); 0 when it names none."""
    if not isinstance(config, dict):
        return 0
    for source in (config, config.get("text_config")):
        value = source.get("vocab_size") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults vLLM reads from generation_config.json (``max_new_tokens`` -> ``max_tokens``)."""
    out = {}
    for key in GENERATION_CONFIG_KEYS:
        value = generation_config.get(key)
        if value is not None:
            out["max_tokens" if key == "max_new_tokens" else key] = value
    return out


def template_special_tokens(bundle: Any) -> dict[str, str]:
    """The named special tokens a template may read (``eos_token`` ...), from tokenizer_config.json."""
    known = getattr(bundle, "template_special_tokens", None)
    if known is not None:
        return dict(known)
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = bundle.tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def check_model(model: str | None, config: RenderConfig) -> str:
    """The served name to answer with; 404 when the request names a model we do not serve."""
    if model is None or model == "":
        return config.model_name
    if model not in config.served_model_names:
        raise model_not_found(model)
    return model


def resolve_chat_template_kwargs(req: ChatCompletionRequest, config: RenderConfig) -> dict[str, Any]:
    """Server defaults (--default-chat-template-kwargs) under the request's own chat_template_kwargs."""
    kwargs = dict(config.default_chat_template_kwargs)
    if req.chat_template_kwargs:
        kwargs.update(req.chat_template_kwargs)
    for forbidden in ("chat_template", "tokenize", "messages", "conversation"):
        if forbidden in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {forbidden!r}", "chat_template_kwargs")
    return kwargs


def load_render_config(model_dir: str, *, max_model_len: int | None = None, tokenizer_dir: str | None = None,
                       **settings: Any) -> RenderConfig:
    """Load the bundle in ``model_dir`` (its tokenizer and templates from ``tokenizer_dir`` when given, as
    vLLM's --tokenizer) and build the per-process configuration (ValueError on bad settings)."""
    from render_service.bundle.model_bundle import load_bundle

    if max_model_len is not None and max_model_len < 1:
        raise ValueError("--max-model-len must be positive")
    settings.setdefault("served_model_names", None)
    bundle = load_bundle(model_dir, max_model_len=max_model_len, tokenizer_path=tokenizer_dir)
    return build_render_config(bundle, **settings)


def _template_file_text(chat_template: str) -> str | None:
    """The text of the file ``chat_template`` names, or None when it names none: template text is not a path
    (a line of it longer than a file name can be makes the OS refuse to look it up)."""
    if len(chat_template) >= 4096 or "\n" in chat_template:
        return None
    from pathlib import Path  # as build_render_config imports it

    path = Path(chat_template)
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except OSError:
        return None


def build_render_config(
    bundle: Any,
    *,
    served_model_names: list[str] | None = None,
    chat_template: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    trust_request_chat_template: bool = False,
    reasoning_field: str = "reasoning",
    return_tokens_as_token_ids: bool = False,
    render_cache_bytes: int | None = None,
    tool_strict_level: str = "auto",
    chat_template_timeout_s: float = DEFAULT_RENDER_SECONDS,
    block_hash_config: BlockHashConfig | None = None,
) -> RenderConfig:
    """The configuration for an already loaded bundle (tests and the gateway share one bundle)."""
    from pathlib import Path

    from render_service.harmony.encoding import harmony_renderer_id, is_harmony_tokenizer
    from render_service.render.fingerprint import config_fingerprint

    harmony = is_harmony_tokenizer(bundle.tokenizer)
    source = bundle.chat_template
    if source is None and chat_template is None:
        from render_service.bundle.builtin_templates import builtin_template_source

        source = builtin_template_source((bundle.config or {}).get("model_type"))  # DeepSeek-V4: no Jinja upstream
    if chat_template is not None:
        # vLLM's --chat-template: a file path, else the template text itself.
        source = _template_file_text(chat_template) or chat_template
    if harmony:
        from render_service.harmony.encoding import harmony_parser_flags

        reasoning_parser, tool_call_parser = harmony_parser_flags(
            None if reasoning_parser == "auto" else reasoning_parser,
            "openai" if tool_call_parser == "auto" else tool_call_parser)
    else:
        from render_service.parsers.auto import resolve_auto

        # --reasoning-parser / --tool-call-parser auto: the family from the template's markers and model_type
        reasoning_parser, tool_call_parser = resolve_auto(reasoning_parser, tool_call_parser, source,
                                                          (bundle.config or {}).get("model_type"),
                                                          bundle.tokenizer_config.get("response_template"))
    if not chat_template_timeout_s > 0:
        raise ValueError("--chat-template-timeout must be positive")
    from render_service.render.reference_mode import reference_render
    from render_service.templates.sandbox import use_plain_reads
    from render_service.templates.tojson_cache import DEFAULT_TEXTS, MAX_CACHE_BYTES
    from render_service.tokenize.incremental_tokenizer import DEFAULT_CACHE_BYTES, IncrementalEncoder

    # --render-cache-bytes, split by the budget (caches/budget.py); the reference switch: none at all, and
    # Jinja's own template reads for the templates compiled from here on
    cache_bytes = DEFAULT_CACHE_BYTES if render_cache_bytes is None else render_cache_bytes
    if reference_render():  # the plain path only (reference_mode.py): no caches, Jinja's own template reads
        cache_bytes = 0
        use_plain_reads(True)
    budget = CacheBudget(CacheShares.of(cache_bytes, MAX_CACHE_BYTES))
    special = template_special_tokens(bundle)
    loops = budget.shares.template_loops  # each template's loop records (templates/loop_resume.py)
    template = ChatTemplate(source, special, time_limit_s=chat_template_timeout_s, loop_record_bytes=loops) \
        if source else None
    tool_source = bundle.chat_templates.get("tool_use") if chat_template is None and not harmony else None
    tool_template = ChatTemplate(tool_source, special, time_limit_s=chat_template_timeout_s,
                                 loop_record_bytes=loops) if tool_source else None
    reasoning_cls = None
    reads_metadata = False  # a parser reads the bundle's response_template: it is part of the fingerprint
    if reasoning_parser:
        from render_service.parsers.registry import get_reasoning_parser
        from render_service.parsers.response_template import bind_parser

        # a parser that reads the bundle's metadata (hf, beam) fails here when the bundle lacks it
        reasoning_cls = bind_parser(get_reasoning_parser(reasoning_parser), bundle.tokenizer)
        reads_metadata = hasattr(reasoning_cls, "bind")
    if tool_call_parser:
        from render_service.parsers.registry import get_tool_parser
        from render_service.parsers.response_template import bind_parser

        tool_cls = bind_parser(get_tool_parser(tool_call_parser), bundle.tokenizer)  # unknown name: error here
        reads_metadata = reads_metadata or hasattr(tool_cls, "bind")
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if tool_strict_level not in TOOL_STRICT_LEVELS:
        raise ValueError(f"--tool-strict-level must be one of {', '.join(TOOL_STRICT_LEVELS)}")
    if reasoning_field not in REASONING_FIELDS:
        raise ValueError(f"--reasoning-field must be one of {', '.join(REASONING_FIELDS)}")
    tokenizer_sha = getattr(bundle, "tokenizer_sha256", None) or _tokenizer_sha256(Path(bundle.path) / "tokenizer.json")
    kwargs = dict(default_chat_template_kwargs or {})
    fingerprint = config_fingerprint(
        tokenizer_sha256=tokenizer_sha,
        chat_template=harmony_renderer_id() if harmony else
        (source or "") + (f"\n{{# tool_use #}}\n{tool_source}" if tool_source else ""),
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        default_chat_template_kwargs=kwargs,
        response_template=bundle.tokenizer.response_template if reads_metadata else None,
    )
    names = list(served_model_names or []) or [str(bundle.path)]

    for name, kept in (("template_loops", template), ("tool_template_loops", tool_template)):
        if kept is not None and kept.loop_records is not None:
            budget.register(name, kept.loop_records.stats)
    DEFAULT_TEXTS.max_bytes = budget.shares.tojson  # (one per process: the templates' tojson filter shares it)
    budget.register("tojson", DEFAULT_TEXTS.lru.stats)
    prompt_encoder = None
    if isinstance(bundle.tokenizer, TextTokenizer):
        prompt_encoder = IncrementalEncoder(bundle.tokenizer, budget.shares.prompt_encoder)
        if prompt_encoder.enabled:
            budget.register("piece", prompt_encoder.cache.lru.stats)
        if prompt_encoder.prefixes is not None:
            budget.register("prompt_store", prompt_encoder.prefixes.stats)
    if harmony:  # the message texts' ids, kept by their text (a conversation's earlier ones come back every turn)
        from render_service.harmony.kept_texts import keep_texts

        texts = keep_texts(bundle.tokenizer, budget.shares.harmony_texts)
        if texts is not None:
            budget.register("harmony_texts", texts.stats)
        from render_service.harmony.turn_records import keep_turn_records

        turns = keep_turn_records(bundle.tokenizer, budget.shares.harmony_turns)
        if turns is not None:
            budget.register("harmony_turns", turns.stats)
    memo = MessageMemo(budget.shares.memo, budget.shares.body_store) if budget.shares.memo > 0 else None
    if memo is not None:
        budget.register("memo", memo.lru.stats)
        if memo.bodies is not None:
            budget.register("body_store", memo.bodies.stats)
    attributions = None
    if budget.shares.masks > 0:
        from render_service.extend.attributions import AttributionCache

        attributions = AttributionCache(budget.shares.masks)
        budget.register("masks", attributions.stats)
    prompt_refs = None
    if budget.shares.prompt_refs > 0:
        from render_service.extend.prompt_refs import PromptRefs

        prompt_refs = PromptRefs(budget.shares.prompt_refs)
        budget.register("prompt_refs", prompt_refs.stats)
    return RenderConfig(
        bundle=bundle,
        served_model_names=names,
        template=template,
        fingerprint=fingerprint,
        tool_template=tool_template,
        default_chat_template_kwargs=kwargs,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        trust_request_chat_template=trust_request_chat_template,
        max_model_len=int(bundle.max_model_len),
        generation_defaults=generation_defaults(bundle.generation_config),
        template_special_tokens=special,
        reasoning_parser_cls=reasoning_cls,
        reasoning_field=reasoning_field,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        harmony=harmony,
        prompt_encoder=prompt_encoder,
        message_memo=memo,
        attributions=attributions,
        prompt_refs=prompt_refs,
        caches=budget,
        tool_strict_level=tool_strict_level,
        chat_template_timeout_s=chat_template_timeout_s,
        block_hash_config=block_hash_config or BlockHashConfig(),
    )


def _tokenizer_sha256(path: Any) -> str:
    from render_service.render.fingerprint import file_sha256

    return file_sha256(path)
