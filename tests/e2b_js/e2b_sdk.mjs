// E2B's JavaScript SDK (npm `e2b`, the exact version in package.json) against Sandlot's
// E2B API: create with metadata and envs, commands (foreground, a non-zero exit raising
// CommandExitError, background + kill), files (write, read, list, exists, remove), list by
// metadata, kill. Run by tests/test_e2b_js.py as `node e2b_sdk.mjs TAG`; the SDK reads
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY from the environment (docs/e2b.md).
// Prints one JSON object on stdout (what the test asserts on). Each step is logged on
// stderr as it starts (so a stuck call is named); any failure exits non-zero.
import { Sandbox, CommandExitError } from 'e2b'

const t0 = performance.now()
const step = (what) =>
  process.stderr.write(`${Math.round(performance.now() - t0)} ms: ${what}\n`)
// Every call ends within 20 s (the SDK then raises), well inside the test's limit.
const lim = { requestTimeoutMs: 20_000 }
const cmd = { ...lim, timeoutMs: 20_000 }

const tag = process.argv[2] || `js-${process.pid}`
const out = {}
step('create')
const sb = await Sandbox.create('base', {
  ...lim,
  metadata: { job: tag },
  envs: { GREETING: 'hello from js' },
  timeoutMs: 120_000,
})
out.sandboxId = sb.sandboxId
try {
  step(`first command in ${sb.sandboxId}`)
  const r = await sb.commands.run('echo $GREETING; pwd; echo to-stderr >&2', cmd)
  out.firstCommandMs = Math.round(performance.now() - t0)
  out.run = { exitCode: r.exitCode, stdout: r.stdout, stderr: r.stderr }

  step('streamed command')
  const chunks = []
  await sb.commands.run('for i in 1 2 3; do echo line$i; done', {
    ...cmd,
    envs: { X: 'y' },
    onStdout: (d) => chunks.push(d),
  })
  out.streamed = chunks.join('')

  step('non-zero exit')
  try {
    await sb.commands.run('echo partial; exit 3', cmd)
    out.nonZero = { raised: false }
  } catch (e) {
    out.nonZero = { raised: e instanceof CommandExitError, exitCode: e.exitCode, stdout: e.stdout }
  }

  step('background command')
  let sawStarted
  const started = new Promise((res) => { sawStarted = res })
  const h = await sb.commands.run('echo started; sleep 60', {
    ...cmd,
    background: true,
    onStdout: (d) => d.includes('started') && sawStarted(),
  })
  out.background = { pid: h.pid, listed: false }
  for (let i = 0; i < 100 && !out.background.listed; i++) {
    out.background.listed = (await sb.commands.list(lim)).some((p) => p.pid === h.pid)
    if (!out.background.listed) await new Promise((res) => setTimeout(res, 100))
  }
  step('kill the background command')
  // Killed once its output has come, so that the output checked below is all there (a kill
  // right after a start ends the command too: tests/conformance/test_processes.py).
  await started
  out.background.killed = await h.kill()
  try {
    await h.wait()
    out.background.waitRaised = false
  } catch (e) {
    out.background.waitRaised = e instanceof CommandExitError
  }
  out.background.stdout = h.stdout
  out.background.listedAfterKill = (await sb.commands.list(lim)).some((p) => p.pid === h.pid)
  out.background.killedAgain = await sb.commands.kill(h.pid, lim)

  step('files')
  const files = {}
  out.files = files
  files.written = (await sb.files.write('/tmp/js/hello.txt', 'hi from node\n', lim)).path
  files.read = await sb.files.read('/tmp/js/hello.txt', lim)
  await sb.files.write('/tmp/js/bytes.bin', new Uint8Array([0, 1, 2, 255]).buffer, lim)
  files.bytes = Array.from(await sb.files.read('/tmp/js/bytes.bin', { ...lim, format: 'bytes' }))
  files.list = (await sb.files.list('/tmp/js', lim)).map((e) => [e.name, e.type, e.size]).sort()
  files.existsBefore = await sb.files.exists('/tmp/js/hello.txt', lim)
  await sb.files.remove('/tmp/js/hello.txt', lim)
  files.existsAfter = await sb.files.exists('/tmp/js/hello.txt', lim)
  files.cat = (await sb.commands.run('od -An -tu1 /tmp/js/bytes.bin', cmd)).stdout.trim()

  step('list and info')
  const found = await Sandbox.list({ ...lim, query: { metadata: { job: tag } } }).nextItems()
  out.list = found.map((s) => ({ id: s.sandboxId, metadata: s.metadata, state: s.state }))
  const info = await sb.getInfo(lim)
  out.info = { templateId: info.templateId, metadata: info.metadata }
} finally {
  step('kill')
  out.killed = await sb.kill(lim)
}
out.killedAgain = await Sandbox.kill(sb.sandboxId, lim)
out.runningAfterKill = await sb.isRunning(lim)
step('done')
process.stdout.write(JSON.stringify(out) + '\n')
