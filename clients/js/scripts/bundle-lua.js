// `npm pack` / `npm publish`: copy the repo's Lua scripts (../../producer/scripts) into lua/, so that the
// package works outside the repo; `--clean` (postpack) removes the copy again, so that a checkout always runs
// the repo's current scripts.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const src = join(root, '..', '..', 'producer', 'scripts');
const dst = join(root, 'lua');

rmSync(dst, { recursive: true, force: true });
if (!process.argv.includes('--clean')) {
  const files = readdirSync(src).filter((f) => f.endsWith('.lua'));
  if (!files.includes('lib.lua')) throw new Error(`no lib.lua in ${src}`);
  mkdirSync(dst);
  for (const f of files) copyFileSync(join(src, f), join(dst, f));
  console.log(`pagedq: bundled ${files.length} Lua scripts from ${src}`);
}
