"""What a request's output must parse as: a JSON schema, any JSON object, a regex, one of several strings, or a
grammar (Lark or GBNF/EBNF). The grammar engine behind it is llguidance (engine.structured.grammars); this module
only says what a constraint is and refuses the ones that are wrong on their face, before anything compiles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON without free whitespace between tokens: a model may otherwise pad with spaces and newlines until it runs
# out of tokens (small models do), and the output is what OpenAI's strict mode returns anyway.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; spec: the schema (a dict), the regex or grammar text, or the list of choices
    (None for json_object)."""

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for a constraint that can never compile; the grammar engine finds the rest."""
        kind, spec = self.kind, self.spec
        if kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "json_schema" and not isinstance(spec, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or true / false)")
        if kind in ("regex", "grammar") and (not isinstance(spec, str) or not spec.strip()):
            raise ValueError(f"the {kind} must be a non-empty string")
        if kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec:
                raise ValueError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in spec):
                raise ValueError("each choice must be a non-empty string")

    @property
    def key(self) -> str:
        """Equal for constraints that compile to the same grammar: what the compile cache is keyed by."""
        return f"{self.kind}:{json.dumps(self.spec, sort_keys=True, separators=(',', ':'))}"

    def grammar(self) -> str:
        """The llguidance grammar this constraint compiles from. Raises ValueError when it cannot be built."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        return grammar_from(self.kind, list(self.spec) if self.kind == "choice" else self.spec)
