// The Lua scripts, shared with the Python client: each script is producer/scripts/lib.lua followed by
// producer/scripts/<name>.lua (Redis has no includes; see producer/scripts.py). A packed package carries copies
// in lua/ (made by `npm pack`, see scripts/bundle-lua.js); in a checkout of the repo they are read from
// producer/scripts, so the two clients always run the same files.

import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

export const NAMES = ['submit', 'start', 'publish', 'complete', 'fail', 'cancel', 'renew', 'release', 'retry'];

const PKG_ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
export const BUNDLED_DIR = join(PKG_ROOT, 'lua');
export const REPO_DIR = join(PKG_ROOT, '..', '..', 'producer', 'scripts');

/** The folder the scripts are read from: the bundled copy when there is one, else the repo's. */
export function scriptsDir() {
  for (const dir of [BUNDLED_DIR, REPO_DIR]) {
    if (existsSync(join(dir, 'lib.lua'))) return dir;
  }
  throw new Error(`pagedq: no Lua scripts in ${BUNDLED_DIR} nor ${REPO_DIR} (a broken install?)`);
}

/** One script: its full source (lib.lua + <name>.lua) and the SHA1 digest EVALSHA names it by. */
export class Script {
  constructor(name, source) {
    this.name = name;
    this.source = source;
    this.sha = createHash('sha1').update(source).digest('hex');
  }
}

const cache = new Map();

export function script(name) {
  let s = cache.get(name);
  if (!s) {
    if (!NAMES.includes(name)) throw new Error(`no script ${name}`);
    const dir = scriptsDir();
    s = new Script(name, readFileSync(join(dir, 'lib.lua'), 'utf8') + readFileSync(join(dir, `${name}.lua`), 'utf8'));
    cache.set(name, s);
  }
  return s;
}

export function isNoScript(err) {
  return typeof err?.message === 'string' && err.message.startsWith('NOSCRIPT');
}

function argv(keys, args) {
  return [String(keys.length), ...keys, ...args.map(String)];
}

/** EVALSHA, falling back to EVAL (which also caches the script) when Redis does not know the digest. */
export async function evalScript(redis, s, keys, args) {
  const a = argv(keys, args);
  try {
    return await redis.sendCommand(['EVALSHA', s.sha, ...a]);
  } catch (err) {
    if (!isNoScript(err)) throw err;
    return redis.sendCommand(['EVAL', s.source, ...a]);
  }
}

/**
 * Many calls of one script in one round trip: node-redis pipelines the commands sent in one tick. Calls that
 * met NOSCRIPT (a fresh or flushed Redis; they did not run) are sent again, once, after a SCRIPT LOAD.
 * Returns one {status: 'fulfilled', value} | {status: 'rejected', reason} per call, in order.
 */
export async function evalMany(redis, s, calls) {
  const send = (c) => redis.sendCommand(['EVALSHA', s.sha, ...argv(c[0], c[1])]);
  const out = await Promise.allSettled(calls.map(send));
  const missing = out.flatMap((r, i) => (r.status === 'rejected' && isNoScript(r.reason) ? [i] : []));
  if (missing.length) {
    await redis.sendCommand(['SCRIPT', 'LOAD', s.source]);
    const again = await Promise.allSettled(missing.map((i) => send(calls[i])));
    missing.forEach((i, j) => { out[i] = again[j]; });
  }
  return out;
}
