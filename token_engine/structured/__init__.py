"""Structured outputs (vLLM's `structured_outputs` sampling parameter) for the tokens-only engine."""

from token_engine.structured.compiler import GrammarCompiler
from token_engine.structured.matcher import GrammarState, apply_grammars_
from token_engine.structured.spec import GrammarError, GuideSpec, parse_structured_outputs

__all__ = ["GrammarCompiler", "GrammarError", "GrammarState", "GuideSpec", "apply_grammars_",
           "parse_structured_outputs"]
