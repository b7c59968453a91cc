"""The sampling fields agree everywhere: producer/sampling_fields.py's table, the Python JobRequest made from it,
serve's OpenAI translation, the engine's SamplingParams (which cannot import it), the JavaScript client's types
(clients/js/index.d.ts) and checks (clients/js/src/request.js), and PROTOCOL.md's table.

A field added to one and not the others fails here, naming the field and the place; so does a default or a bound
that differs. Bounds are checked by behaviour: the values at each bound are taken, the values just past it refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import pytest
from pydantic import ValidationError

from engine import SamplingParams
from producer import sampling_fields
from producer.protocol import JobRequest
from producer.sampling_fields import SAMPLING, SamplingField
from serve.errors import APIError
from serve.translate import parse
from worker.validate import sampling_params

ROOT = Path(__file__).resolve().parents[2]
TABLE = "producer/sampling_fields.py"
JS = ROOT / "clients" / "js"

# JobRequest's fields that are not sampling fields (the table's): a field of JobRequest in neither fails.
NOT_SAMPLING = {"id", "model", "prompt", "messages", "response_format", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "lane", "priority", "group", "timeout_s", "metadata"}
# SamplingParams' fields no job field sets under their name.
ENGINE_OWN = {"min_tokens": "not on the job (yet): the engine's API only",
              "constraint": "from the job's response_format or guided_* (JobRequest.constraint)"}
# Fields a probe needs beside the one probed, for the engine to take it.
COMPANIONS = {"beam_width": {"use_beam_search": True, "temperature": 0}, "use_beam_search": {"temperature": 0}}
# What the JavaScript client takes narrower than Python, on purpose.
JS_NARROWER = {"seed": "a safe integer (within +-(2^53 - 1)): a larger number is not exact in JavaScript"}


def _below(x: float, integer: bool) -> float:
    return x - 1 if integer else math.nextafter(x, -math.inf)


def _above(x: float, integer: bool) -> float:
    return x + 1 if integer else math.nextafter(x, math.inf)


def probes(f: SamplingField) -> list[tuple[Any, bool]]:
    """(value, whether a job takes it) at and just past each of the field's bounds."""
    item = typing.get_args(f.type)[0] if typing.get_origin(f.type) is list else f.type
    integer = int in _base_types(item)
    cast = int if integer else float
    out = []
    if f.ge is not None:
        out += [(cast(f.ge), True), (_below(cast(f.ge), integer), False)]
    if f.gt is not None:
        out += [(cast(f.gt), False), (_above(cast(f.gt), integer), True)]
    if f.le is not None:
        out += [(cast(f.le), True), (_above(cast(f.le), integer), False)]
    if typing.get_origin(f.type) is list:
        out = [([v], ok) for v, ok in out]
    return out


def _base_types(tp: Any) -> set[Any]:
    """Python types a value of `tp` may be; a Literal counts as its values' type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return set().union(*(_base_types(a) for a in typing.get_args(tp)))
    if origin is Literal:
        return {type(a) for a in typing.get_args(tp)}
    if origin is list:
        return {list}
    return {tp}


def _ts_types(tp: Any) -> set[str]:
    """The TypeScript spellings of a field's type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return set().union(*(_ts_types(a) for a in typing.get_args(tp)))
    if origin is Literal:
        return {f"'{a}'" for a in typing.get_args(tp)}
    if origin is list:
        return {f"{t}[]" for t in _ts_types(typing.get_args(tp)[0])}
    return {int: {"number"}, float: {"number"}, bool: {"boolean"}, str: {"string"}, type(None): {"null"}}[tp]


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _job(name: str, value: Any) -> dict:
    return {"prompt": "x", **COMPANIONS.get(name, {}), name: value}


# The table and the Python JobRequest.

def test_the_table_is_well_formed():
    names = [f.name for f in SAMPLING]
    assert len(set(names)) == len(names), f"{TABLE}: a field is listed twice"
    for f in SAMPLING:
        if f.bounds:
            assert _base_types(f.type) & {int, float, list}, f"{TABLE}: {f.name} has bounds but is not a number"
        if typing.get_origin(f.type) is list:
            assert f.default == [], f"{TABLE}: {f.name} is a list: its default is []"
        elif f.default is not None:
            assert type(f.default) in _base_types(f.type) or isinstance(f.default, int) and float in _base_types(
                f.type), f"{TABLE}: {f.name}'s default {f.default!r} is not a {f.type}"


def test_job_request_has_the_table_fields_and_no_other():
    fields = JobRequest.model_fields
    for f in SAMPLING:
        assert f.name in fields, f"producer/protocol.py JobRequest lacks {f.name}, which {TABLE} has"
        default = fields[f.name].get_default(call_default_factory=True)
        assert _same(default, f.default), (f"producer/protocol.py JobRequest.{f.name} defaults to {default!r}, "
                                           f"{TABLE} says {f.default!r}")
    unknown = set(fields) - NOT_SAMPLING - set(sampling_fields.BY_NAME)
    assert not unknown, (f"producer/protocol.py JobRequest has {sorted(unknown)}, in neither {TABLE} nor this "
                         f"test's NOT_SAMPLING: a sampling field is a row of the table")


@pytest.mark.parametrize("f", [f for f in SAMPLING if f.bounds], ids=lambda f: f.name)
def test_job_request_takes_exactly_the_table_bounds(f: SamplingField):
    for value, ok in probes(f):
        try:
            JobRequest(**_job(f.name, value))
            took = True
        except ValidationError:
            took = False
        assert took == ok, f"producer/protocol.py JobRequest {'refuses' if ok else 'takes'} {f.name}={value!r}"


# The engine: SamplingParams restates the table.

def _engine_fields() -> dict[str, dataclasses.Field]:
    return {fl.name: fl for fl in dataclasses.fields(SamplingParams)}


def test_engine_sampling_params_has_the_table_fields():
    engine = _engine_fields()
    for f in SAMPLING:
        if f.engine:
            assert f.name in engine, (f"engine/sampling_params.py SamplingParams lacks {f.name}, which {TABLE} "
                                      f"says the engine takes (engine=True)")
        else:
            assert f.name not in engine, f"engine/sampling_params.py SamplingParams has {f.name}: {TABLE} says no"
    unknown = set(engine) - set(ENGINE_OWN) - {f.name for f in SAMPLING if f.engine}
    assert not unknown, (f"engine/sampling_params.py SamplingParams has {sorted(unknown)}, which {TABLE} lacks: "
                         f"add a row (or, if no job sets it, name it in this test's ENGINE_OWN)")


def test_engine_defaults_and_types_are_the_table():
    engine = _engine_fields()
    hints = typing.get_type_hints(SamplingParams)
    for f in SAMPLING:
        if not f.engine:
            continue
        fl = engine[f.name]
        default = fl.default_factory() if fl.default is dataclasses.MISSING else fl.default
        assert _same(default, f.default_in_engine), (
            f"engine/sampling_params.py SamplingParams.{f.name} defaults to {default!r}, {TABLE} says "
            f"{f.default_in_engine!r} (engine_default, where the engine's differs from the job's)")
        assert _base_types(hints[f.name]) == _base_types(f.type), (
            f"engine/sampling_params.py SamplingParams.{f.name} is {hints[f.name]}, {TABLE} says {f.type}")


@pytest.mark.parametrize("f", [f for f in SAMPLING if f.engine and f.bounds], ids=lambda f: f.name)
def test_engine_takes_every_value_a_job_may_have(f: SamplingField):
    # The engine may take more (it is a library too); never less, or a valid job would fail in the worker.
    for value, ok in probes(f):
        if ok:
            try:
                sampling_params(JobRequest(**_job(f.name, value)))
            except Exception as e:
                pytest.fail(f"engine/sampling_params.py SamplingParams refuses {f.name}={value!r}, which {TABLE} "
                            f"allows: {e}")


def _other_value(f: SamplingField) -> Any:
    """A value of the field that a job takes and that is not its default."""
    taken = [v for v, ok in probes(f) if ok and not _same(v, f.default)]
    if taken:
        return taken[-1]
    for tp in typing.get_args(f.type) or (f.type,):
        if typing.get_origin(tp) is Literal:
            return typing.get_args(tp)[0]
    if f.type is bool:
        return not f.default
    if typing.get_origin(f.type) is list:
        return ["x"]
    raise AssertionError(f"this test has no value for {f.name} other than its default: teach _other_value one")


@pytest.mark.parametrize("f", [f for f in SAMPLING if f.engine], ids=lambda f: f.name)
def test_the_worker_passes_the_field_to_the_engine(f: SamplingField):
    value = _other_value(f)
    params = sampling_params(JobRequest(**_job(f.name, value)))
    assert getattr(params, f.name) == value, f"worker/validate.py does not pass {f.name}={value!r} to the engine"


def test_a_job_gets_the_jobs_defaults_not_the_engines():
    params = sampling_params(JobRequest(prompt="x"))
    for f in SAMPLING:
        if f.engine and f.name != "seed":  # a job without one gets one fixed by its id
            assert _same(getattr(params, f.name), f.default), f"worker/validate.py gives {f.name} another default"


# serve: OpenAI bodies onto the table's fields.

@pytest.mark.parametrize("f", [f for f in SAMPLING if f.copied], ids=lambda f: f.name)
def test_serve_copies_the_field_from_both_endpoints(f: SamplingField):
    value = next((v for v, ok in probes(f) if ok), [] if isinstance(f.default, list) else f.default)
    for kind, body in (("chat", {"messages": [{"role": "user", "content": "x"}]}), ("completion", {"prompt": "x"})):
        got = parse(kind, {"model": "m", **body, **COMPANIONS.get(f.name, {}), f.name: value}).request
        assert getattr(got, f.name) == value, f"serve/translate.py does not copy {f.name} on {kind}"


def test_serve_reads_each_openai_name_on_its_endpoints_only():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    completion = {"model": "m", "prompt": "x"}
    assert parse("chat", {**chat, "max_completion_tokens": 5}).request.max_tokens == 5
    assert parse("chat", {**chat, "logprobs": True, "top_logprobs": 3}).request.logprobs == 3
    assert parse("completion", {**completion, "logprobs": 3}).request.logprobs == 3
    for f in SAMPLING:
        for name in f.chat:
            with pytest.raises(APIError, match=f"Unrecognized request argument supplied: {name}"):
                parse("completion", {**completion, name: 1})
    for name in {f.name for f in SAMPLING if not f.openai}:  # beam_width: the width is best_of, else n
        with pytest.raises(APIError, match=f"Unrecognized request argument supplied: {name}"):
            parse("chat", {**chat, name: 2})


# The JavaScript client: its types and its checks.

def _ts_interface(name: str) -> dict[str, tuple[bool, set[str]]]:
    """{field: (optional, its types)} of an interface in clients/js/index.d.ts."""
    text = (JS / "index.d.ts").read_text()
    found = re.search(rf"^export interface {name} \{{\n(.*?)^\}}", text, re.M | re.S)
    assert found, f"clients/js/index.d.ts has no interface {name}"
    out = {}
    for line in found.group(1).splitlines():
        m = re.match(r"^  (\w+)(\??): (.+);$", line)
        if m:
            out[m.group(1)] = (m.group(2) == "?", {t.strip() for t in m.group(3).split("|")})
    return out


def test_js_types_have_the_table_fields():
    ts = _ts_interface("JobRequest")
    for f in SAMPLING:
        assert f.name in ts, f"clients/js/index.d.ts JobRequest lacks {f.name}, which {TABLE} has"
        optional, spelled = ts[f.name]
        assert optional, f"clients/js/index.d.ts JobRequest.{f.name} must be optional ({f.name}?): it has a default"
        want = _ts_types(f.type) | ({"null"} if f.default is None else set())
        assert want <= spelled, (f"clients/js/index.d.ts JobRequest.{f.name} is {' | '.join(sorted(spelled))}, "
                                 f"{TABLE}'s {f.type} needs {' | '.join(sorted(want - spelled))} too")
    unknown = set(ts) - set(JobRequest.model_fields)
    assert not unknown, f"clients/js/index.d.ts JobRequest has {sorted(unknown)}, which producer/protocol.py lacks"


def _js_defaults() -> dict[str, Any]:
    """clients/js/src/request.js's DEFAULTS, read as JSON."""
    text = (JS / "src" / "request.js").read_text()
    block = re.search(r"^const DEFAULTS = \{\n(.*?)^\};", text, re.M | re.S)
    assert block, "clients/js/src/request.js has no `const DEFAULTS = {...};`"
    out = {}
    for m in re.finditer(r"^  (\w+): (.+),$", block.group(1), re.M):
        try:
            out[m.group(1)] = json.loads(m.group(2))
        except ValueError:
            out[m.group(1)] = m.group(2)  # a constant (DEFAULT_LANE) or undefined: not a sampling field's
    return out


def test_js_defaults_are_the_table():
    js = _js_defaults()
    assert list(js) == list(JobRequest.model_fields), (
        "clients/js/src/request.js DEFAULTS differ from producer/protocol.py JobRequest's fields: only in JS "
        f"{sorted(set(js) - set(JobRequest.model_fields))}, only in Python "
        f"{sorted(set(JobRequest.model_fields) - set(js))} (or another order)")
    for f in SAMPLING:
        assert _same(js[f.name], f.default), (f"clients/js/src/request.js DEFAULTS.{f.name} is {js[f.name]!r}, "
                                              f"{TABLE} says {f.default!r}")


_JS_PROBE = """
import { makeRequest } from './src/request.js';
const limits = Object.fromEntries(Object.keys((await import('./src/request.js')).DEFAULT_LIMITS)
  .map((k) => [k, Number.MAX_SAFE_INTEGER]));
const out = JSON.parse(process.argv[1]).map((job) => {
  try { makeRequest(job, limits); return null; } catch (e) { return e.message; }
});
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS client's checks not run")
def test_js_takes_exactly_the_table_bounds():
    cases = [(f, value, ok) for f in SAMPLING if f.name not in JS_NARROWER for value, ok in probes(f)]
    jobs = [_job(f.name, value) for f, value, _ in cases]
    run = subprocess.run(["node", "--input-type=module", "-e", _JS_PROBE, json.dumps(jobs)], cwd=JS,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    wrong = [f"{f.name}={value!r}: " + ("refused: " + err if ok else "taken")
             for (f, value, ok), err in zip(cases, json.loads(run.stdout)) if (err is None) != ok]
    assert not wrong, f"clients/js/src/request.js makeRequest differs from {TABLE}:\n" + "\n".join(wrong)


# PROTOCOL.md's table of what a producer sends.

def _protocol_rows() -> dict[str, str]:
    """{field: its default as written} of PROTOCOL.md's JobRequest table."""
    text = (ROOT / "PROTOCOL.md").read_text()
    section = text[text.index("## What a producer sends"):text.index("## What a consumer reads")]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`(\w+)`", cells[0])
        defaults = [d.strip() for d in cells[2].split(", ")] if len(names) > 1 else [cells[2]]
        if len(defaults) == 1:
            defaults *= len(names)
        out.update(zip(names, defaults))
    return out


def _md_value(text: str) -> Any:
    word = text.split(" ")[0]
    return {"null": None, "[]": [], "{}": {}, "false": False, "true": True}.get(word) if not re.match(
        r"^-?\d", word) else json.loads(word)


def test_protocol_md_lists_the_table():
    rows = _protocol_rows()
    for f in SAMPLING:
        assert f.name in rows, f"PROTOCOL.md's table (What a producer sends) lacks {f.name}, which {TABLE} has"
        assert _same(_md_value(rows[f.name]), f.default), (
            f"PROTOCOL.md's table gives {f.name} the default {rows[f.name]!r}, {TABLE} says {f.default!r}")
    unknown = set(rows) - set(JobRequest.model_fields)
    assert not unknown, f"PROTOCOL.md's table has {sorted(unknown)}, which producer/protocol.py JobRequest lacks"
