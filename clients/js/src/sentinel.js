// Redis behind Sentinel: `redis+sentinel://` URLs, the JavaScript twin of producer/sentinel.py.
//
//   redis+sentinel://[user:password@]host1:26379,host2:26379/<service>[/<db>][?sentinel_username=..&sentinel_password=..]
//   rediss+sentinel://...   TLS, to the Sentinels and to the data nodes alike
//
// The user and password are the data nodes' (what `sentinel auth-pass` holds); sentinel_username and
// sentinel_password are the Sentinels' own, when they require one. A port left out is 26379.
//
// node-redis's RedisSentinel finds the primary through the Sentinels and follows it after a failover; its
// sendCommand takes a read-only flag first, so SentinelConnection wraps it in the few calls the Client makes of a
// node-redis client (sendCommand(args), duplicate, connect, close, destroy, isOpen, isReady, on).

import { createSentinel } from 'redis';

export const SCHEMES = { 'redis+sentinel:': false, 'rediss+sentinel:': true }; // scheme -> TLS
export const DEFAULT_PORT = 26379;
const SENTINEL_AUTH = { sentinel_username: 'username', sentinel_password: 'password' };

export function isSentinelUrl(url) {
  return typeof url === 'string' && url.split('//', 1)[0].toLowerCase() in SCHEMES;
}

/** The URL without its passwords, fit for errors. */
export function redact(url) {
  return String(url).replace(/(\/\/[^:@/]*:)[^@/]*@/, '$1***@').replace(/(sentinel_password=)[^&]*/, '$1***');
}

function hostPort(item, url) {
  let host;
  let port;
  const v6 = /^\[([^\]]+)\](?::(.*))?$/.exec(item);
  if (v6) [, host, port] = v6;
  else {
    const i = item.lastIndexOf(':');
    [host, port] = i < 0 ? [item, ''] : [item.slice(0, i), item.slice(i + 1)];
  }
  if (!host) throw new TypeError(`Sentinel URL ${redact(url)}: an empty host in the Sentinel list`);
  if (port && !/^\d+$/.test(port)) throw new TypeError(`Sentinel URL ${redact(url)}: ${JSON.stringify(item)} is not host:port`);
  return { host: decodeURIComponent(host), port: port ? Number(port) : DEFAULT_PORT };
}

/**
 * Parses a `redis+sentinel://` or `rediss+sentinel://` URL into createSentinel() options. Throws TypeError saying
 * what is wrong.
 */
export function parseSentinelUrl(url) {
  const scheme = String(url).split('//', 1)[0].toLowerCase();
  if (!(scheme in SCHEMES)) {
    throw new TypeError(`not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): ${redact(url)}`);
  }
  const tls = SCHEMES[scheme];
  // URL() cannot parse a host list: split it by hand (authority, path, query).
  const rest = String(url).slice(scheme.length + 2);
  const [beforeQuery, query = ''] = rest.split('?', 2);
  const slash = beforeQuery.indexOf('/');
  const authority = slash < 0 ? beforeQuery : beforeQuery.slice(0, slash);
  const path = slash < 0 ? '' : beforeQuery.slice(slash);
  const at = authority.lastIndexOf('@');
  const userinfo = at < 0 ? '' : authority.slice(0, at);
  const hosts = (at < 0 ? authority : authority.slice(at + 1)).split(',').map((h) => h.trim()).filter(Boolean);
  if (!hosts.length) {
    throw new TypeError(`Sentinel URL ${redact(url)} names no Sentinel: use `
      + 'redis+sentinel://host1:26379,host2:26379/<service>[/<db>]');
  }
  const sentinelRootNodes = hosts.map((h) => hostPort(h, url));
  const parts = path.split('/').filter(Boolean).map(decodeURIComponent);
  if (!parts.length || parts.length > 2 || (parts.length === 2 && !/^\d+$/.test(parts[1]))) {
    throw new TypeError(`Sentinel URL ${redact(url)}: the path must be /<service> or /<service>/<db>, the service `
      + 'being the name Sentinel monitors (`sentinel monitor <service> ...`)');
  }
  const nodeClientOptions = { database: parts.length === 2 ? Number(parts[1]) : 0 };
  if (userinfo) {
    const [user, pass] = userinfo.split(':', 2);
    if (pass !== undefined) {
      nodeClientOptions.password = decodeURIComponent(pass);
      if (user) nodeClientOptions.username = decodeURIComponent(user);
    } else if (user) nodeClientOptions.password = decodeURIComponent(user); // redis://:pass@ and redis://pass@ alike
  }
  const sentinelClientOptions = {};
  for (const [k, v] of new URLSearchParams(query)) {
    if (!(k in SENTINEL_AUTH)) throw new TypeError(`Sentinel URL ${redact(url)}: unknown option ${JSON.stringify(k)}`);
    sentinelClientOptions[SENTINEL_AUTH[k]] = v;
  }
  if (tls) {
    nodeClientOptions.socket = { tls: true };
    sentinelClientOptions.socket = { tls: true };
  }
  return { name: parts[0], sentinelRootNodes, nodeClientOptions, sentinelClientOptions };
}

/** A RedisSentinel with the calls of a node-redis client that the pagedq Client makes. */
export class SentinelConnection {
  constructor(options) {
    this.options = options;
    this.sentinel = createSentinel(options);
  }

  on(event, listener) {
    this.sentinel.on(event, listener);
    return this;
  }

  get isOpen() {
    return this.sentinel.isOpen;
  }

  get isReady() {
    return this.sentinel.isReady;
  }

  async connect() {
    await this.sentinel.connect();
    return this;
  }

  /** Every command goes to the primary (pagedq's reads must see its own writes). */
  sendCommand(args) {
    return this.sentinel.sendCommand(false, args);
  }

  /** A connection of its own (for a blocking XREAD), through the same Sentinels. */
  duplicate() {
    return new SentinelConnection(this.options);
  }

  close() {
    return this.sentinel.close();
  }

  destroy() {
    return this.sentinel.destroy();
  }
}

/**
 * A client of the service's current primary (no I/O until connect()). `node`: more options for the connections to
 * the data nodes (the Client passes its reconnect strategy and disableOfflineQueue, see client.js).
 */
export function connectSentinel(url, node = {}) {
  const options = parseSentinelUrl(url);
  const { socket, ...rest } = node;
  options.nodeClientOptions = { ...options.nodeClientOptions, ...rest,
    socket: { ...options.nodeClientOptions.socket, ...socket } };
  // Its nodes' connection errors reach the 'error' listener too (the Client reports the last one).
  options.passthroughClientErrorEvents = true;
  return new SentinelConnection(options);
}
