// model-gate: a policy in JavaScript (componentize-js), written from wit/policy.wit alone.
//
// Refuses requests for listed models, or whose selected header carries a listed value, with
// the configured 4xx status and message; every refusal is logged through the host. Allowed
// requests pass unchanged. The binding must select the header (`headers = [...]`).
// Configuration (checked against schema.json beside this file):
//
//   {"models": ["big-*", "legacy"], "header": "x-client", "values": ["scraper"],
//    "status": 403, "message": "not served here"}
//
// A model entry ending in `*` matches every model name starting with what precedes it (a `*`
// anywhere else refuses the configuration).
//
// How the WIT maps to JavaScript: the export `policy` is an object of camelCase functions;
// records are objects with camelCase fields; a variant is `{ tag: 'kebab-name', val }`; an
// enum value is its kebab-case name as a string; flags are an object of booleans; `option<T>`
// is `undefined` or the value; a `result<T, string>` returns T and throws the error string.

import { log } from 'bulkhead:policy/host@0.1.1';

// Set by `configure`, once when the set loads: the gateway snapshots the configured instance.
let config = null;

function parse(text) {
  const raw = JSON.parse(text);
  const models = raw.models ?? [];
  const exact = new Set(models.filter((m) => !m.endsWith('*')));
  const prefixes = models.filter((m) => m.endsWith('*')).map((m) => m.slice(0, -1));
  // A rule the schema does not state: the plugin refuses it when the set loads.
  for (const m of models) {
    if (m.indexOf('*') !== -1 && m.indexOf('*') !== m.length - 1) {
      throw `model entry ${JSON.stringify(m)}: a * may only end it`;
    }
  }
  return {
    exact,
    prefixes,
    header: raw.header?.toLowerCase(),
    values: new Set(raw.values ?? []),
    status: raw.status ?? 403,
    message: raw.message,
  };
}

function deny(status, message) {
  return { tag: 'deny', val: { status, message } };
}

function why(request) {
  const { model } = request;
  if (config.exact.has(model) || config.prefixes.some((p) => model.startsWith(p))) {
    return `model ${model} is not available`;
  }
  if (config.header !== undefined) {
    // Every value counts: a proxy on the way may have appended one after the client's.
    const sent = request.headers.find(
      (h) => h.name === config.header && config.values.has(h.value),
    );
    if (sent !== undefined) {
      return `${config.header} ${JSON.stringify(sent.value)} is refused`;
    }
  }
  return null;
}

export const policy = {
  configure(text) {
    try {
      config = parse(text);
    } catch (e) {
      throw typeof e === 'string' ? e : `bad configuration: ${e.message}`;
    }
    return { onRequest: true, onDisconnect: false, onResponseEnd: false };
  },

  onRequest(request) {
    const reason = why(request);
    if (reason === null) {
      return { tag: 'allow', val: { tags: [], clampMaxTokens: undefined, addHeaders: [] } };
    }
    log('info', `denied ${request.requestId} of ${request.tenant}: ${reason}`);
    return deny(config.status, config.message ?? reason);
  },

  onDisconnect(_event) {
    return 'abort-now';
  },

  onResponseEnd(_event) {},
};
