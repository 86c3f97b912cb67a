// token-cap: a policy in C (wit-bindgen + clang + wasi-libc), written from wit/policy.wit alone.
//
// Caps the tokens a request may generate per tenant: a request asking for more than its
// tenant's cap is allowed, clamped to the cap, and (when `header` is set) its response carries
// that header with the cap. It never denies. Configuration (checked against schema.json beside
// this file):
//
//   {"default": 1024, "tenants": {"tenant-a": 256}, "header": "x-bulkhead-token-cap"}
//
// `default` caps the tenants not listed; without it they are not capped.
//
// How the WIT maps to C (`wit-bindgen c wit/` writes plugin.h, plugin.c and
// plugin_component_type.o): each exported function is a C function this file defines, named
// `exports_bulkhead_policy_policy_NAME`; records are structs, a variant is a `tag` and a `val`
// union, enums and flags are integers with `#define`d values, `option<T>` is `{is_some, val}`,
// strings and lists are `{ptr, len}` (not NUL-terminated). The arguments belong to the callee
// (free them with the generated `*_free`); whatever is returned is freed with `free()` after
// the call, so every string and list returned must come from `malloc`. A `result<T, string>`
// returns `true` and writes `*ret`, or returns `false` and writes `*err`.

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "plugin.h"

// One tenant's cap. `name` is UTF-8 from `malloc`, `cap` at least 1.
typedef struct {
  uint8_t *name;
  size_t name_len;
  uint32_t cap;
} tenant_cap_t;

// The configuration, set by `configure` (once when the set loads: the gateway snapshots the
// configured instance). `default_cap` is 0 when unlisted tenants are not capped; `header` is NULL when no
// response header is added.
static struct {
  uint32_t default_cap;
  tenant_cap_t *tenants;
  size_t tenant_count;
  uint8_t *header;
  size_t header_len;
} config;

// A failed allocation traps: the gateway fails the request closed.
static void *must_alloc(size_t size) {
  void *p = malloc(size ? size : 1);
  if (p == NULL) {
    abort();
  }
  return p;
}

// Writes `n` in decimal to `out` (at least 10 bytes); returns the length.
static size_t decimal(uint32_t n, char *out) {
  char reversed[10];
  size_t len = 0;
  do {
    reversed[len++] = (char)('0' + n % 10);
    n /= 10;
  } while (n != 0);
  for (size_t i = 0; i < len; i++) {
    out[i] = reversed[len - 1 - i];
  }
  return len;
}

// --- A small JSON reader, enough for this configuration ---------------------------------------

// `at` moves towards `end`; `error` is the first problem found (NULL while there is none).
typedef struct {
  const uint8_t *start;
  const uint8_t *at;
  const uint8_t *end;
  const char *error;
} json_t;

static bool fail(json_t *j, const char *why) {
  if (j->error == NULL) {
    j->error = why;
  }
  return false;
}

static void skip_space(json_t *j) {
  while (j->at < j->end && (*j->at == ' ' || *j->at == '\t' || *j->at == '\n' || *j->at == '\r')) {
    j->at++;
  }
}

// True (and consumed) when the next character is `c`.
static bool take(json_t *j, uint8_t c) {
  skip_space(j);
  if (j->at < j->end && *j->at == c) {
    j->at++;
    return true;
  }
  return false;
}

static bool expect(json_t *j, uint8_t c, const char *why) {
  return take(j, c) || fail(j, why);
}

static int hex_digit(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Four hex digits after `\u`.
static bool hex4(json_t *j, uint32_t *out) {
  if (j->end - j->at < 4) {
    return fail(j, "a \\u escape needs four hex digits");
  }
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    int d = hex_digit(j->at[i]);
    if (d < 0) {
      return fail(j, "a \\u escape needs four hex digits");
    }
    v = v << 4 | (uint32_t)d;
  }
  j->at += 4;
  *out = v;
  return true;
}

static size_t utf8(uint32_t cp, uint8_t *out) {
  if (cp < 0x80) {
    out[0] = (uint8_t)cp;
    return 1;
  }
  if (cp < 0x800) {
    out[0] = (uint8_t)(0xC0 | cp >> 6);
    out[1] = (uint8_t)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (uint8_t)(0xE0 | cp >> 12);
    out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    out[2] = (uint8_t)(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = (uint8_t)(0xF0 | cp >> 18);
  out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
  out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
  out[3] = (uint8_t)(0x80 | (cp & 0x3F));
  return 4;
}

// A string, unescaped into a fresh buffer from `malloc` (`*out`, `*len`).
static bool string(json_t *j, uint8_t **out, size_t *len) {
  if (!expect(j, '"', "expected a string")) {
    return false;
  }
  // Unescaping never lengthens: the rest of the input bounds the result.
  uint8_t *buf = must_alloc((size_t)(j->end - j->at));
  size_t n = 0;
  while (j->at < j->end && *j->at != '"') {
    uint8_t c = *j->at++;
    if (c < 0x20) {
      free(buf);
      return fail(j, "a control character in a string");
    }
    if (c != '\\') {
      buf[n++] = c;
      continue;
    }
    if (j->at == j->end) {
      break;
    }
    uint8_t e = *j->at++;
    uint32_t cp;
    switch (e) {
      case '"': case '\\': case '/': buf[n++] = e; break;
      case 'b': buf[n++] = '\b'; break;
      case 'f': buf[n++] = '\f'; break;
      case 'n': buf[n++] = '\n'; break;
      case 'r': buf[n++] = '\r'; break;
      case 't': buf[n++] = '\t'; break;
      case 'u':
        if (!hex4(j, &cp)) {
          free(buf);
          return false;
        }
        if (cp >= 0xD800 && cp < 0xDC00) {
          uint32_t low;
          if (j->end - j->at < 2 || j->at[0] != '\\' || j->at[1] != 'u') {
            free(buf);
            return fail(j, "a lone surrogate in a \\u escape");
          }
          j->at += 2;
          if (!hex4(j, &low) || low < 0xDC00 || low > 0xDFFF) {
            free(buf);
            return fail(j, "a lone surrogate in a \\u escape");
          }
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        } else if (cp >= 0xDC00 && cp < 0xE000) {
          free(buf);
          return fail(j, "a lone surrogate in a \\u escape");
        }
        n += utf8(cp, buf + n);
        break;
      default:
        free(buf);
        return fail(j, "an unknown escape in a string");
    }
  }
  if (j->at == j->end) {
    free(buf);
    return fail(j, "an unterminated string");
  }
  j->at++;
  *out = buf;
  *len = n;
  return true;
}

// A whole number from 1 to 2^32 - 1 (`256` or `256.0`).
static bool count(json_t *j, uint32_t *out) {
  skip_space(j);
  uint64_t v = 0;
  const uint8_t *digits = j->at;
  while (j->at < j->end && *j->at >= '0' && *j->at <= '9') {
    v = v * 10 + (uint64_t)(*j->at++ - '0');
    if (v > UINT32_MAX) {
      return fail(j, "a count above 4294967295");
    }
  }
  if (j->at == digits) {
    return fail(j, "expected a whole number");
  }
  if (j->at < j->end && *j->at == '.') {
    j->at++;
    while (j->at < j->end && *j->at == '0') {
      j->at++;
    }
  }
  if (j->at < j->end && ((*j->at >= '1' && *j->at <= '9') || *j->at == 'e' || *j->at == 'E')) {
    return fail(j, "expected a whole number");
  }
  if (v == 0) {
    return fail(j, "a cap must be at least 1");
  }
  *out = (uint32_t)v;
  return true;
}

static bool key_is(const uint8_t *key, size_t len, const char *name) {
  return len == strlen(name) && memcmp(key, name, len) == 0;
}

// The members of `tenants`: tenant name → cap.
static bool tenants(json_t *j) {
  if (!expect(j, '{', "`tenants` must be an object")) {
    return false;
  }
  if (take(j, '}')) {
    return true;
  }
  do {
    tenant_cap_t t;
    if (!string(j, &t.name, &t.name_len)) {
      return false;
    }
    if (!expect(j, ':', "expected ':'") || !count(j, &t.cap)) {
      free(t.name);
      return false;
    }
    tenant_cap_t *grown = realloc(config.tenants, (config.tenant_count + 1) * sizeof *grown);
    if (grown == NULL) {
      abort();
    }
    config.tenants = grown;
    config.tenants[config.tenant_count++] = t;
  } while (take(j, ','));
  return expect(j, '}', "expected ',' or '}' in `tenants`");
}

static bool parse_config(json_t *j) {
  if (!expect(j, '{', "the configuration must be an object")) {
    return false;
  }
  if (take(j, '}')) {
    return true;
  }
  do {
    uint8_t *key;
    size_t len;
    if (!string(j, &key, &len)) {
      return false;
    }
    bool ok = expect(j, ':', "expected ':'");
    if (ok && key_is(key, len, "default")) {
      ok = count(j, &config.default_cap);
    } else if (ok && key_is(key, len, "tenants")) {
      ok = tenants(j);
    } else if (ok && key_is(key, len, "header")) {
      free(config.header);
      ok = string(j, &config.header, &config.header_len);
    } else if (ok) {
      ok = fail(j, "an unknown field (known: default, tenants, header)");
    }
    free(key);
    if (!ok) {
      return false;
    }
  } while (take(j, ','));
  if (!expect(j, '}', "expected ',' or '}'")) {
    return false;
  }
  skip_space(j);
  return j->at == j->end || fail(j, "text after the configuration");
}

// --- The policy --------------------------------------------------------------------------------

// The cap of `tenant`, 0 when it has none.
static uint32_t cap_of(const plugin_string_t *tenant) {
  for (size_t i = 0; i < config.tenant_count; i++) {
    const tenant_cap_t *t = &config.tenants[i];
    if (t->name_len == tenant->len && memcmp(t->name, tenant->ptr, tenant->len) == 0) {
      return t->cap;
    }
  }
  return config.default_cap;
}

bool exports_bulkhead_policy_policy_configure(plugin_string_t *text,
                                              exports_bulkhead_policy_policy_hooks_t *ret,
                                              plugin_string_t *err) {
  json_t j = {text->ptr, text->ptr, text->ptr + text->len, NULL};
  bool ok = parse_config(&j);
  if (!ok) {
    // "bad configuration at byte N: why"
    const char *lead = "bad configuration at byte ";
    const char *why = j.error != NULL ? j.error : "unreadable";
    char offset[10];
    size_t offset_len = decimal((uint32_t)(j.at - j.start), offset);
    size_t lead_len = strlen(lead), why_len = strlen(why);
    size_t len = lead_len + offset_len + 2 + why_len;
    char *message = must_alloc(len);
    memcpy(message, lead, lead_len);
    memcpy(message + lead_len, offset, offset_len);
    memcpy(message + lead_len + offset_len, ": ", 2);
    memcpy(message + lead_len + offset_len + 2, why, why_len);
    err->ptr = (uint8_t *)message;
    err->len = len;
  } else {
    *ret = BULKHEAD_POLICY_TYPES_HOOKS_ON_REQUEST;
  }
  plugin_string_free(text);
  return ok;
}

void exports_bulkhead_policy_policy_on_request(exports_bulkhead_policy_policy_request_view_t *request,
                                               exports_bulkhead_policy_policy_verdict_t *ret) {
  memset(ret, 0, sizeof *ret);
  ret->tag = BULKHEAD_POLICY_TYPES_VERDICT_ALLOW;
  bulkhead_policy_types_mutations_t *allow = &ret->val.allow;
  uint32_t cap = cap_of(&request->tenant);
  if (cap != 0 && request->max_tokens > cap) {
    allow->clamp_max_tokens.is_some = true;
    allow->clamp_max_tokens.val = cap;
    if (config.header != NULL) {
      bulkhead_policy_types_header_t *h = must_alloc(sizeof *h);
      char digits[10];
      plugin_string_dup_n(&h->name, (const char *)config.header, config.header_len);
      plugin_string_dup_n(&h->value, digits, decimal(cap, digits));
      allow->add_headers.ptr = h;
      allow->add_headers.len = 1;
    }
  }
  exports_bulkhead_policy_policy_request_view_free(request);
}

exports_bulkhead_policy_policy_directive_t exports_bulkhead_policy_policy_on_disconnect(
    exports_bulkhead_policy_policy_disconnect_t *event) {
  // Not asked for in `configure`'s hooks: the gateway never calls it.
  exports_bulkhead_policy_policy_disconnect_free(event);
  return BULKHEAD_POLICY_TYPES_DIRECTIVE_ABORT_NOW;
}

void exports_bulkhead_policy_policy_on_response_end(exports_bulkhead_policy_policy_response_end_t *event) {
  // Not asked for in `configure`'s hooks: the gateway never calls it.
  exports_bulkhead_policy_policy_response_end_free(event);
}
