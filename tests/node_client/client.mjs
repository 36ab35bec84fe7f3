// A conveyor client in Node.js, written from docs/protocol.md alone (no Python involved):
// it adds one request to a model's lane, follows the request's output stream to its final
// entry and prints the result as one JSON line. tests/test_node_client.py runs it against a
// real worker and compares its answer with the Python client's.
//
//   node client.mjs --redis unix:///path/redis.sock --model tiny --prompt "Hello" \
//       --params '{"max_tokens": 16, "temperature": 0}'
//
// Exit status: 0 when the request finished (whatever its finish_reason), 1 on a protocol
// error (a gap in the stream, a malformed entry), 3 when --max-queue refused the request,
// 124 when --wait-s passed first (the request is then cancelled).

import { randomUUID } from 'node:crypto';
import { parseArgs } from 'node:util';

import { decode, encode } from '@msgpack/msgpack';
import { createClient, RESP_TYPES } from 'redis';

const SCHEMA_VERSION = 1;
// Stream entries hold one field, `m`, with one msgpack map.
const FIELD = 'm';
// The consumer group workers read request streams with.
const GROUP = 'workers';
const CANCEL_MARKER_TTL_S = 3600;
// Entries per XREAD, and how long one XREAD blocks (the deadline is checked in between).
const READ_COUNT = 512;
const READ_BLOCK_MS = 1000;
// Replies as Buffers: entry values are msgpack bytes, not text.
const BYTES = { typeMapping: { [RESP_TYPES.BLOB_STRING]: Buffer } };

class ProtocolError extends Error {}

function options() {
  const { values } = parseArgs({
    options: {
      redis: { type: 'string', default: process.env.CONVEYOR_REDIS_URL ?? 'redis://localhost:6379' },
      namespace: { type: 'string', default: 'conveyor' },
      model: { type: 'string' },
      lane: { type: 'string', default: 'interactive' },
      id: { type: 'string' },
      prompt: { type: 'string' },
      'prompt-token-ids': { type: 'string' }, // comma-separated
      messages: { type: 'string' }, // JSON: [{"role": "user", "content": "...", "name"?: ...}]
      'chat-template-kwargs': { type: 'string' }, // JSON: {"enable_thinking": false}
      tools: { type: 'string' }, // JSON: [{"type": "function", "function": {"name": ...}}]
      params: { type: 'string', default: '{}' }, // JSON: SamplingParams fields
      priority: { type: 'string', default: '0' },
      'timeout-ms': { type: 'string' }, // sets deadline_ms, enforced by the worker
      'max-queue': { type: 'string' }, // add only while the lane holds fewer waiting
      'wait-s': { type: 'string', default: '60' }, // how long to follow before cancelling
    },
  });
  if (!values.model) throw new Error('--model is required');
  return values;
}

// `redis://`, `rediss://` or `unix://[user:password@]/path.sock[?db=N]`.
function connectOptions(url) {
  if (!url.startsWith('unix://')) return { url };
  let rest = url.slice('unix://'.length);
  const [where, query = ''] = rest.split('?');
  rest = where;
  const auth = {};
  if (!rest.startsWith('/')) {
    const at = rest.indexOf('@');
    const [user, password] = rest.slice(0, at).split(':');
    if (user) auth.username = decodeURIComponent(user);
    if (password) auth.password = decodeURIComponent(password);
    rest = rest.slice(at + 1);
  }
  const db = new URLSearchParams(query).get('db');
  return { socket: { path: rest }, ...auth, ...(db ? { database: Number(db) } : {}) };
}

function requestMessage(opts) {
  // Optional fields left out take their defaults (docs/protocol.md, "Request").
  const message = {
    v: SCHEMA_VERSION,
    id: opts.id ?? randomUUID().replaceAll('-', ''),
    model: opts.model,
    params: JSON.parse(opts.params),
    priority: Number(opts.priority),
    lane: opts.lane,
    created_ms: Date.now(),
  };
  if (opts.prompt !== undefined) message.prompt = opts.prompt;
  if (opts['prompt-token-ids'] !== undefined) {
    message.prompt_token_ids = opts['prompt-token-ids'].split(',').map(Number);
  }
  if (opts.messages !== undefined) message.messages = JSON.parse(opts.messages);
  // Only when given: a worker from before the field refuses it (docs/protocol.md).
  if (opts['chat-template-kwargs'] !== undefined) {
    message.chat_template_kwargs = JSON.parse(opts['chat-template-kwargs']);
  }
  if (opts.tools !== undefined) message.tools = JSON.parse(opts.tools);
  if (opts['timeout-ms'] !== undefined) {
    message.deadline_ms = message.created_ms + Number(opts['timeout-ms']);
  }
  return message;
}

// XADD, or with a queue limit the server-side function that counts the lane and its handoff
// stream and adds only below the limit (Redis >= 7, `conveyor redis setup` loads it).
// Returns the entry id, or null when the queue is full.
async function addRequest(client, ns, message, maxQueue) {
  const lane = `${ns}:req:{${message.model}}:${message.lane}`;
  const payload = Buffer.from(encode(message));
  if (maxQueue === undefined) {
    return String(await client.sendCommand(['XADD', lane, '*', FIELD, payload]));
  }
  const handoff = `${ns}:handoff:{${message.model}}:${message.lane}`;
  const [status, value] = await client.sendCommand(
    ['FCALL', 'conveyor_add_if_room', '2', lane, handoff, GROUP, String(maxQueue), FIELD, payload]);
  return String(status) === 'ok' ? String(value) : null;
}

async function cancel(client, ns, requestId) {
  // The marker first: a worker that reads the request later still sees it.
  await client.multi()
    .set(`${ns}:cancelled:${requestId}`, '1', { EX: CANCEL_MARKER_TTL_S })
    .publish(`${ns}:cancel`, requestId)
    .exec();
}

// Follows `{ns}:out:{id}` until its final entry; null when `waitS` passed first.
async function follow(client, ns, requestId, waitS) {
  const key = `${ns}:out:${requestId}`;
  const deadline = Date.now() + waitS * 1000;
  const result = { id: requestId, token_ids: [], text: '' };
  let lastId = '0-0';
  while (Date.now() < deadline) {
    const reply = await client.sendCommand(
      ['XREAD', 'COUNT', String(READ_COUNT), 'BLOCK', String(READ_BLOCK_MS), 'STREAMS', key, lastId],
      BYTES);
    for (const [, entries] of reply ?? []) {
      for (const [entryId, fields] of entries) {
        lastId = entryId.toString();
        const entry = decodeEntry(fields);
        if (entry.kind === 'chunk') {
          // Token indexes arrive in order, each once: anything else is a lost write.
          if (entry.index !== result.token_ids.length) {
            throw new ProtocolError(`gap: chunk at token ${entry.index}, ` +
              `${result.token_ids.length} tokens read`);
          }
          result.token_ids.push(...entry.token_ids);
          result.text += entry.text;
          // Only when params.logprobs was set: [logprob, [[token id, logprob], ...]] per token.
          if (entry.logprobs) (result.logprobs ??= []).push(...entry.logprobs);
        } else if (entry.kind === 'final') {
          if (entry.num_tokens !== result.token_ids.length) {
            throw new ProtocolError(`gap: final says ${entry.num_tokens} tokens, ` +
              `${result.token_ids.length} read`);
          }
          result.text += entry.text;
          return { ...result, entry_id: lastId, finish_reason: entry.finish_reason,
            num_tokens: entry.num_tokens, usage: entry.usage, error: entry.error };
        } else {
          throw new ProtocolError(`unknown entry kind ${entry.kind}`);
        }
      }
    }
  }
  return null;
}

function decodeEntry(fields) {
  // fields: [name, value, name, value, ...]
  for (let i = 0; i < fields.length; i += 2) {
    if (fields[i].toString() === FIELD) {
      const entry = decode(fields[i + 1]);
      if (entry?.v !== SCHEMA_VERSION) throw new ProtocolError(`schema version ${entry?.v}`);
      return entry;
    }
  }
  throw new ProtocolError('entry without an m field');
}

async function main() {
  const opts = options();
  const client = createClient(connectOptions(opts.redis));
  client.on('error', (err) => console.error(`redis: ${err.message}`));
  await client.connect();
  try {
    const message = requestMessage(opts);
    const maxQueue = opts['max-queue'] === undefined ? undefined : Number(opts['max-queue']);
    if (await addRequest(client, opts.namespace, message, maxQueue) === null) {
      console.log(JSON.stringify({ id: message.id, error: 'queue full' }));
      return 3;
    }
    const result = await follow(client, opts.namespace, message.id, Number(opts['wait-s']));
    if (result === null) {
      await cancel(client, opts.namespace, message.id);
      console.log(JSON.stringify({ id: message.id, error: 'timed out: cancelled' }));
      return 124;
    }
    console.log(JSON.stringify(result));
    return 0;
  } catch (err) {
    if (!(err instanceof ProtocolError)) throw err;
    console.error(`protocol error: ${err.message}`);
    return 1;
  } finally {
    await client.close();
  }
}

process.exitCode = await main();
