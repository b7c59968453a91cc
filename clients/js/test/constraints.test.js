// Structured output: response_format and the guided_* fields, validated as producer/protocol.py does it (the
// same rules, checked against Python). Constrained jobs through a real worker are in client.test.js (its worker).
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { DEFAULT_LIMITS, InvalidRequestError, encodeRequest, makeRequest } from '../src/index.js';
import { JSON_SCHEMA, SCHEMA, python } from './helpers.js';


describe('constraint validation', () => {
  const bad = [
    [{ response_format: { type: 'json_object' }, guided_choice: ['a'] }, 'guided_choice',
      /give at most one constraint; got response_format, guided_choice/],
    [{ guided_regex: 'a+', guided_grammar: 'start: "a"' }, 'guided_grammar', /at most one constraint; got guided_regex, guided_grammar/],
    [{ guided_choice: [] }, 'guided_choice', /non-empty array of strings/],
    [{ guided_choice: ['yes', ''] }, 'guided_choice[1]', /non-empty string/],
    [{ guided_choice: 'yes' }, 'guided_choice', /array/],
    [{ guided_regex: '' }, 'guided_regex', /non-empty string/],
    [{ guided_grammar: 5 }, 'guided_grammar', /non-empty string/],
    [{ guided_json: '{not json' }, 'guided_json', /not valid JSON/],
    [{ guided_json: [1, 2] }, 'guided_json', /JSON schema/],
    [{ guided_json: { type: 'object', default: new Date(0) } }, 'guided_json', /plain JSON/],
    [{ response_format: { type: 'xml' } }, 'response_format.type', /must be text, json_object or json_schema, got "xml"/],
    [{ response_format: 'json' }, 'response_format', /must be an object/],
    [{ response_format: { type: 'json_object', schema: {} } }, 'response_format', /of type json_object does not take schema/],
    [{ response_format: { type: 'json_schema' } }, 'response_format.json_schema', /with a schema/],
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: 'an object' } } },
      'response_format.json_schema.schema', /JSON Schema object/],
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: {}, format: 1 } } },
      'response_format.json_schema', /does not take format/],
    [{ guided_choice: ['a', 'b'], use_beam_search: true, temperature: 0 }, 'guided_choice',
      /beam search does not take a constraint \(guided_choice\)/],
    [{ response_format: JSON_SCHEMA, use_beam_search: true, temperature: 0 }, 'response_format', /beam search/],
    [{ guided_json: { enum: ['x'.repeat(70_000)] } }, 'guided_json',
      /the json_schema constraint is 70013 bytes as JSON, the limit is 65536/],
    [{ guided_regex: 'é'.repeat(40_000) }, 'guided_regex', /the regex constraint is 80002 bytes/],
  ];
  for (const [fields, field, message] of bad) {
    test(`refuses ${JSON.stringify(fields)?.slice(0, 70)}`, () => {
      assert.throws(() => makeRequest({ prompt: 'p', ...fields }), (err) => {
        assert.ok(err instanceof InvalidRequestError, err);
        assert.equal(err.field, field);
        assert.match(err.message, message);
        assert.ok(err.message.startsWith(`invalid job request: ${field}: `), err.message);
        return true;
      });
    });
  }

  test('max_constraint_bytes is a limit like the others', () => {
    assert.equal(DEFAULT_LIMITS.max_constraint_bytes, 65536);
    const req = { prompt: 'p', guided_choice: ['yes', 'no'] }; // ["yes","no"]: 12 bytes
    assert.doesNotThrow(() => makeRequest(req, { max_constraint_bytes: 12 }));
    assert.throws(() => makeRequest(req, { max_constraint_bytes: 11 }), /the choice constraint is 12 bytes as JSON, the limit is 11/);
    const any = { prompt: 'p', response_format: { type: 'json_object' } }; // no spec: null, 4 bytes
    assert.throws(() => makeRequest(any, { max_constraint_bytes: 3 }), /json_object constraint is 4 bytes/);
  });

  test('the wire JSON is what Python sends, and Python refuses what JavaScript refuses', () => {
    const cases = [
      { id: 'a', prompt: 'p', response_format: JSON_SCHEMA },
      { id: 'b', prompt: 'p', response_format: { type: 'json_object' } },
      { id: 'c', prompt: 'p', response_format: { type: 'text' }, guided_regex: '[a-z]{1,5}' }, // text: no constraint
      { id: 'd', prompt: 'p', guided_json: JSON.stringify(SCHEMA) }, // a schema's text is parsed
      { id: 'e', prompt: 'p', guided_json: false },
      { id: 'f', prompt: 'p', guided_choice: ['yes', 'no'], n: 2 },
      { id: 'g', prompt: 'p', guided_grammar: 'start: "a"+', response_format: null, guided_json: null },
    ];
    const wire = cases.map((c) => encodeRequest(makeRequest(c)));
    const refused = bad.map(([fields]) => ({ prompt: 'p', ...fields }))
      .filter((r) => !JSON.stringify(r).includes('1970')); // a Date has no JSON form to send Python
    // Through a file: the large cases do not fit in a command line.
    const dir = mkdtempSync(join(tmpdir(), 'pagedq-js-constraints-'));
    const data = join(dir, 'cases.json');
    writeFileSync(data, JSON.stringify({ cases, wire, refused }));
    let py;
    try {
      py = python(`
import json, os
from producer.protocol import JobRequest, Limits
d = json.load(open(os.environ["CASES"]))
cases, wire, refused = d["cases"], d["wire"], d["refused"]
def dump(r):
    return json.loads(r.model_dump_json(exclude_defaults=True))
def accepted(r):
    try:
        Limits().check(JobRequest.model_validate(r))
        return True
    except ValueError:
        return False
print(json.dumps({"python": [dump(JobRequest.model_validate(c)) for c in cases],
                  "roundtrip": [dump(JobRequest.model_validate_json(w)) for w in wire],
                  "kinds": [list(JobRequest.model_validate_json(w).constraint or [None])[0] for w in wire],
                  "accepted": [accepted(r) for r in refused]}))`, { CASES: data });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
    const js = wire.map((w) => JSON.parse(w));
    assert.deepEqual(js, py.python);
    assert.deepEqual(py.roundtrip, js);
    assert.deepEqual(py.kinds, ['json_schema', 'json_object', 'regex', 'json_schema', 'json_schema', 'choice', 'grammar']);
    assert.deepEqual(js[3].guided_json, SCHEMA);
    assert.deepEqual(Object.keys(js[6]), ['id', 'prompt', 'guided_grammar'], 'null constraints are defaults: left out');
    assert.deepEqual(py.accepted, refused.map(() => false));
  });
});
