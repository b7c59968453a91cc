"""A request's constraint (JSON schema, regex, grammar, choice) checked by the grammar engine before its job is
queued: a constraint the worker would refuse is a 400 naming the field and the problem. Verdicts are remembered
(serve.verdicts), so the many requests that share a spec compile it once. The live routes run checks off the event
loop within a time budget (serve.checks); a batch's lines here, on their reader's thread."""

from __future__ import annotations

from typing import Any

from serve.errors import APIError, bad_request
from serve.verdicts import FINE, VERDICTS, Verdict, Verdicts, spec_key

INVALID = "invalid_constraint"


def problem(kind: str, spec: Any) -> str:
    """The grammar engine's objection to a constraint ("" if none), compiled without the model's tokenizer (the
    worker compiles it again, and fails the job should that find more)."""
    try:
        from llguidance import LLMatcher, grammar_from
    except ImportError:  # the grammar engine is the worker's: a front without it leaves the check to the worker
        return ""
    try:  # the engine's grammars (engine.structured.constraints) differ only in options that cannot make one invalid
        grammar = grammar_from("json_schema" if kind == "json_object" else kind,
                               {"type": "object"} if kind == "json_object" else spec)
        return LLMatcher.validate_grammar(grammar).strip()
    except (ValueError, TypeError) as e:
        return str(e)


def refusal(verdict: Verdict, kind: str, param: str) -> APIError | None:
    if verdict.code == INVALID:
        return bad_request(f"{param}: invalid {kind} constraint: {verdict.problem}", param, INVALID)
    if verdict.code:
        return bad_request(f"{param}: {verdict.problem}", param, verdict.code)
    return None


def check_now(constraint: tuple[str, Any], param: str, verdicts: Verdicts = VERDICTS) -> None:
    """Check on the calling thread (a batch's lines: their reader gives each check its budget, serve.check_budget);
    the verdicts are the live routes'."""
    kind, spec = constraint
    key = spec_key(kind, spec)
    verdict = verdicts.get(key)
    if verdict is None:
        found = problem(kind, spec)
        verdict = Verdict(INVALID, found) if found else FINE
        verdicts.put(key, verdict)
    err = refusal(verdict, kind, param)
    if err is not None:
        raise err
