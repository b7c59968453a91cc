// index.d.ts is hand-written: the TypeScript compiler checks it, and a file that uses the whole API against it.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

test('index.d.ts compiles and types real use (tsc --noEmit)', () => {
  const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
  const cwd = fileURLToPath(new URL('..', import.meta.url));
  const run = spawnSync(process.execPath, [tsc, '-p', 'tsconfig.json'], { cwd, encoding: 'utf8' });
  assert.equal(run.status, 0, `tsc failed:\n${run.stdout}${run.stderr}`);
});
