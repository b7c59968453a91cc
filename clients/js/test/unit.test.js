// No Redis, no worker: request validation, the wire format and the key names against the Python side, the
// script loader and the packed package.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { fileURLToPath, pathToFileURL } from 'node:url';
import {
  Client, DEFAULT_LIMITS, InvalidRequestError, Keys, TERMINAL_EVENT, TERMINAL_STATES, STATES, encodeRequest,
  makeRequest,
} from '../src/index.js';
import { BUNDLED_DIR, REPO_DIR, script, scriptsDir } from '../src/scripts.js';
import { ENTRY_ID, ENTRY_JOB, ERR_DUPLICATE, ERR_NOT_FOUND, EVENT_FIELD } from '../src/wire.js';
import { python } from './helpers.js';

const PKG = fileURLToPath(new URL('..', import.meta.url));

describe('requests', () => {
  const bad = [
    [{}, 'prompt', /exactly one of prompt or messages/],
    [{ prompt: 'a', messages: [{ role: 'user', content: 'b' }] }, 'prompt', /exactly one/],
    [{ prompt: '' }, 'prompt', /empty/],
    [{ messages: [] }, 'messages', /empty/],
    [{ messages: [{ role: '', content: 'x' }] }, 'messages[0].role', /1-64/],
    [{ messages: [{ role: 'user' }] }, 'messages[0].content', /string/],
    [{ messages: [{ role: 'user', content: 'x', name: 'n' }] }, 'messages[0].name', /unknown field/],
    [{ prompt: 'a', max_tokens: 0 }, 'max_tokens', />= 1/],
    [{ prompt: 'a', max_tokens: 1.5 }, 'max_tokens', /integer/],
    [{ prompt: 'a', max_tokens: '5' }, 'max_tokens', /integer/],
    [{ prompt: 'a', max_tokens: 40_000 }, 'max_tokens', /limit is 32768/],
    [{ prompt: 'a', maxTokens: 5 }, 'maxTokens', /unknown field/],
    [{ prompt: 'a', temperature: NaN }, 'temperature', /finite/],
    [{ prompt: 'a', temperature: -1 }, 'temperature', />= 0/],
    [{ prompt: 'a', top_p: 0 }, 'top_p', /> 0/],
    [{ prompt: 'a', top_k: -2 }, 'top_k', />= -1/],
    [{ prompt: 'a', logprobs: 21 }, 'logprobs', /<= 20/],
    [{ prompt: 'a', stop: [1] }, 'stop', /strings/],
    [{ prompt: 'a', stop: Array(17).fill('x') }, 'stop', /limit is 16/],
    [{ prompt: 'a', stop_token_ids: [-1] }, 'stop_token_ids[0]', />= 0/],
    [{ prompt: 'a', ignore_eos: 1 }, 'ignore_eos', /true or false/],
    [{ prompt: 'a', timeout_s: 0 }, 'timeout_s', /> 0/],
    [{ prompt: 'a', id: 'has space' }, 'id', /printable ASCII/],
    [{ prompt: 'a', id: 'x'.repeat(201) }, 'id', /1-200/],
    [{ prompt: 'a', metadata: { at: new Date() } }, 'metadata', /plain JSON/],
    [{ prompt: 'a', metadata: { n: Infinity } }, 'metadata', /finite/],
    [{ prompt: 'a', metadata: [] }, 'metadata', /plain object/],
    [{ prompt: 'a', metadata: { big: 'x'.repeat(20_000) } }, 'metadata', /limit is 16384/],
    ['a prompt', 'request', /plain object/],
    [{ prompt: 'a', n: 0 }, 'n', />= 1/],
    [{ prompt: 'a', n: 17 }, 'n', /n is 17, the limit is 16/],
    [{ prompt: 'a', n: 2, best_of: 40 }, 'best_of', /best_of is 40, the limit is 32/],
    [{ prompt: 'a', use_beam_search: true, beam_width: 33, temperature: 0 }, 'beam_width', /limit is 32/],
    [{ prompt: 'a', use_beam_search: 'yes' }, 'use_beam_search', /true or false/],
    [{ prompt: 'a', early_stopping: 'sometimes' }, 'early_stopping', /"never"/],
  ];
  for (const [req, field, message] of bad) {
    test(`refuses ${JSON.stringify(req)?.slice(0, 60)}`, () => {
      assert.throws(() => makeRequest(req), (err) => {
        assert.ok(err instanceof InvalidRequestError, err);
        assert.equal(err.field, field);
        assert.match(err.message, message);
        assert.match(err.message, new RegExp(`^invalid job request: ${field.replace(/[[\]]/g, '\\$&')}: `));
        return true;
      });
    });
  }

  test('limits count code points, as Python does, and can be changed', () => {
    assert.doesNotThrow(() => makeRequest({ prompt: '😀'.repeat(10) }, { max_prompt_chars: 10 }));
    assert.throws(() => makeRequest({ prompt: 'x'.repeat(11) }, { max_prompt_chars: 10 }), /limit is 10/);
    assert.throws(() => makeRequest({ prompt: 'x', max_tokens: 65 }, { max_tokens: 64 }), /limit is 64/);
    assert.equal(DEFAULT_LIMITS.max_tokens, 32768);
  });

  test('fills defaults and makes an id', () => {
    const a = makeRequest({ prompt: 'hi' });
    const b = makeRequest({ prompt: 'hi', stop: 'x', id: null, seed: undefined });
    assert.match(a.id, /^[0-9a-f]{32}$/);
    assert.notEqual(a.id, b.id);
    assert.equal(a.max_tokens, 256);
    assert.deepEqual(b.stop, ['x']);
    assert.equal(b.seed, null);
  });

  test('the wire JSON is what Python sends (JobRequest, exclude_defaults) and what Python reads back', () => {
    const cases = [
      { id: 'a', prompt: 'hi' },
      { id: 'b', messages: [{ role: 'user', content: 'héllo "x"\n' }], max_tokens: 5, temperature: 0, stop: 'x' },
      { id: 'c', prompt: 'p', model: 'm', top_p: 0.5, top_k: 3, min_p: 0.1, seed: 7, stop_token_ids: [2],
        ignore_eos: true, logprobs: 2, priority: -1, timeout_s: 30, metadata: { user: 'u', n: [1, { a: null }] },
        presence_penalty: 0.5, frequency_penalty: -1, repetition_penalty: 1.2 },
      { id: 'e', prompt: 'p', n: 3, best_of: 5 },
      { id: 'f', prompt: 'p', n: 2, use_beam_search: true, beam_width: 4, length_penalty: 0.5,
        early_stopping: 'never', temperature: 0 },
      { id: 'd', prompt: 'p', max_tokens: 256, temperature: 1, stop: [], metadata: {}, n: 1 }, // all defaults: left out
    ];
    const wire = cases.map((c) => encodeRequest(makeRequest(c)));
    const py = python(`
import json
from producer.protocol import JobRequest
cases = ${JSON.stringify(JSON.stringify(cases))}
wire = ${JSON.stringify(JSON.stringify(wire))}
out = {"python": [json.loads(JobRequest.model_validate(c).model_dump_json(exclude_defaults=True)) for c in json.loads(cases)],
       "roundtrip": [json.loads(JobRequest.model_validate_json(w).model_dump_json(exclude_defaults=True)) for w in json.loads(wire)]}
print(json.dumps(out))`);
    const js = wire.map((w) => JSON.parse(w));
    assert.deepEqual(js, py.python);
    assert.deepEqual(py.roundtrip, js);
    assert.deepEqual(Object.keys(js[5]), ['id', 'prompt']);
  });
});

describe('names shared with the Python side', () => {
  test('key names match producer/keys.py', () => {
    const k = new Keys('q-1.a:b');
    const py = python(`
import json
from producer.keys import Keys
k = Keys("q-1.a:b")
print(json.dumps([k.jobs, k.dlq, k.group, k.job("j1"), k.events("j1"), k.result("j1")]))`);
    assert.deepEqual([k.jobs, k.dlq, k.group, k.job('j1'), k.events('j1'), k.result('j1')], py);
    assert.equal(k.job('j1'), 'pq:{q-1.a:b}:job:j1');
    assert.throws(() => new Keys('a{b}'), /queue name/);
    assert.throws(() => new Client({ queue: 'has space' }), /queue name/);
  });

  test('wire names match the Python ones', () => {
    const py = python(`
import json
try:
    from producer import wire as w
except ImportError:  # before producer/wire.py existed
    from producer import keys as w
    w.ERR_DUPLICATE, w.ERR_NOT_FOUND = "DUPLICATE", "NOT_FOUND"
from producer.protocol import TERMINAL
states = getattr(w, "STATES", None)
print(json.dumps({"fields": [w.ENTRY_ID, w.ENTRY_JOB, w.EVENT_FIELD], "errors": [w.ERR_DUPLICATE, w.ERR_NOT_FOUND],
                  "terminal": list(TERMINAL), "states": list(states) if states else None}))`);
    assert.deepEqual([ENTRY_ID, ENTRY_JOB, EVENT_FIELD], py.fields);
    assert.deepEqual([ERR_DUPLICATE, ERR_NOT_FOUND], py.errors);
    assert.deepEqual(TERMINAL_STATES, py.terminal);
    assert.deepEqual(Object.keys(TERMINAL_EVENT), py.terminal);
    if (py.states) assert.deepEqual(STATES, py.states);
  });
});

describe('scripts', () => {
  test('each script is lib.lua + <name>.lua, read from the repo in a checkout', () => {
    if (!existsSync(BUNDLED_DIR)) assert.equal(scriptsDir(), REPO_DIR);
    const s = script('submit');
    assert.match(s.source, /^-- lib:/);
    assert.match(s.source, /\n-- submit:/);
    assert.match(s.sha, /^[0-9a-f]{40}$/);
    assert.throws(() => script('nope'), /no script/);
  });

  test('the packed package carries the Lua scripts and runs them from its own copy', async () => {
    const tmp = mkdtempSync(join(tmpdir(), 'pagedq-js-pack-'));
    try {
      const out = execFileSync('npm', ['pack', '--json', '--pack-destination', tmp], { cwd: PKG, encoding: 'utf8',
        stdio: ['ignore', 'pipe', 'pipe'] });
      const [info] = JSON.parse(out.slice(out.indexOf('[')));
      const files = info.files.map((f) => f.path);
      for (const f of ['lua/lib.lua', 'lua/submit.lua', 'lua/cancel.lua', 'src/index.js', 'index.d.ts', 'README.md']) {
        assert.ok(files.includes(f), `${f} not in ${files}`);
      }
      assert.ok(!files.some((f) => f.startsWith('test/') || f.startsWith('node_modules/')), String(files));
      assert.ok(!existsSync(join(PKG, 'lua')), 'postpack left lua/ behind');
      execFileSync('tar', ['-xzf', join(tmp, info.filename), '-C', tmp]);
      const packed = await import(pathToFileURL(join(tmp, 'package', 'src', 'scripts.js')).href);
      assert.equal(packed.scriptsDir(), join(tmp, 'package', 'lua'));
      assert.equal(packed.script('submit').sha, script('submit').sha);
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
  });
});
