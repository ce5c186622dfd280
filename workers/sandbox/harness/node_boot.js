// Warm-sandbox bootstrap for Node. Blocks on the control pipe, then does one of (as the Python
// bootstrap does; see python_boot.py for the whole design):
//   run    load /work/main.js as the main module;
//   serve  the candidate side of a graded execution: load /work/main.js (the host appends an
//          accessor that lets this bootstrap look up the module's top-level functions), then
//          answer the driver's calls by value over the link pipes until the driver closes them;
//   drive  the grader side, in its own sandbox: run the task's prelude and tests with the
//          candidate's functions bound to proxies that call across the link, compare here, and
//          report the verdict (with the key the candidate never sees) on the feedback pipe.
// The exit status comes from the status waiter (PID 1), not from here. Values cross as the
// tagged JSON of wire.py: {"$t"|"$s"|"$fs"|"$d"|"$b"|"$f"|"$c"|"$u": ...}.
"use strict";
const fs = require("fs");
const Module = require("module");
const [ctlFd, feedbackFd, linkIn, linkOut] = process.argv.slice(1, 5).map(Number);
const WIRE_MAX = 16 << 20;
const DEPTH = 200;
const LOOKUP = "__crucibleLookup__";
const IDENT = /^[A-Za-z_$][\w$]*$/;

function writeAll(fd, buf) {
  let at = 0;
  while (at < buf.length) {
    try {
      at += fs.writeSync(fd, buf, at, buf.length - at);
    } catch (e) {
      if (e.code !== "EAGAIN") throw e;
    }
  }
}

function record(text) {
  const body = Buffer.from(text, "utf8");
  const head = Buffer.alloc(8);
  head.write("CRF1", 0, "latin1");
  head.writeUInt32BE(body.length, 4);
  writeAll(feedbackFd, Buffer.concat([head, body]));
}

class WireError extends Error {}
class Gone extends Error {}

function readExactly(fd, n) {
  const buf = Buffer.alloc(n);
  let got = 0;
  while (got < n) {
    let k;
    try {
      k = fs.readSync(fd, buf, got, n - got, null);
    } catch (e) {
      if (e.code === "EAGAIN") continue;
      if (e.code === "EOF" || e.code === "EPIPE") return got === 0 ? null : buf.subarray(0, got);
      throw e;
    }
    if (k === 0) return got === 0 ? null : buf.subarray(0, got);
    got += k;
  }
  return buf;
}

function readMessage() {
  const head = readExactly(linkIn, 4);
  if (head === null) return null;
  if (head.length < 4) throw new WireError("truncated frame");
  const size = head.readUInt32BE(0);
  if (size > WIRE_MAX) throw new WireError(`frame of ${size} bytes`);
  const body = size ? readExactly(linkIn, size) : Buffer.alloc(0);
  if (body === null || body.length < size) throw new WireError("truncated frame");
  let parsed;
  try {
    parsed = JSON.parse(body.toString("ascii"));
  } catch (e) {
    throw new WireError("not JSON");
  }
  return decode(parsed, 0);
}

function sendMessage(value) {
  let text;
  try {
    text = escapeAscii(JSON.stringify(encode(value, 0)));
  } catch (e) {
    text = escapeAscii(JSON.stringify(["error", String(e.message).slice(0, 500)]));
  }
  const body = Buffer.from(text, "ascii");
  if (body.length > WIRE_MAX) throw new WireError("message too large");
  const head = Buffer.alloc(4);
  head.writeUInt32BE(body.length, 0);
  writeAll(linkOut, Buffer.concat([head, body]));
}

function escapeAscii(s) {
  // JSON.stringify keeps non-ASCII as is; the wire is ASCII (as Python's side writes it).
  return s.replace(/[\u0080-\uffff]/g, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
}

function encode(v, depth) {
  if (depth > DEPTH) throw new WireError("value nested too deeply to send");
  if (v === undefined) return { $u: null };
  if (v === null || typeof v === "boolean" || typeof v === "string") return v;
  if (typeof v === "number") {
    if (Number.isNaN(v)) return { $f: "nan" };
    if (!Number.isFinite(v)) return { $f: v > 0 ? "inf" : "-inf" };
    return v;
  }
  if (Array.isArray(v)) return v.map((x) => encode(x, depth + 1));
  if (v instanceof Set) return { $s: [...v].map((x) => encode(x, depth + 1)) };
  if (v instanceof Map) return { $d: [...v].map(([k, x]) => [encode(k, depth + 1), encode(x, depth + 1)]) };
  if (v instanceof Uint8Array) return { $b: Buffer.from(v).toString("hex") };
  if (typeof v === "object") {
    const proto = Object.getPrototypeOf(v);
    if (proto === Object.prototype || proto === null) {
      return { $d: Object.keys(v).map((k) => [k, encode(v[k], depth + 1)]) };
    }
  }
  throw new WireError(`a ${typeof v === "object" ? v.constructor?.name || "object" : typeof v} cannot be passed by value`);
}

function decode(v, depth) {
  if (depth > DEPTH) throw new WireError("value nested too deeply");
  if (v === null || typeof v !== "object") return v;
  if (Array.isArray(v)) return v.map((x) => decode(x, depth + 1));
  const keys = Object.keys(v);
  if (keys.length !== 1) throw new WireError("a wire object has exactly one tag");
  const tag = keys[0];
  const body = v[tag];
  if ((tag === "$t" || tag === "$s" || tag === "$fs") && Array.isArray(body)) {
    const items = body.map((x) => decode(x, depth + 1));
    return tag === "$t" ? items : new Set(items);
  }
  if (tag === "$d" && Array.isArray(body)) {
    const pairs = body.map((p) => {
      if (!Array.isArray(p) || p.length !== 2) throw new WireError("a dict item is a pair");
      return [decode(p[0], depth + 1), decode(p[1], depth + 1)];
    });
    if (pairs.every(([k]) => typeof k === "string")) {
      const obj = {};
      for (const [k, x] of pairs) Object.defineProperty(obj, k, { value: x, enumerable: true, writable: true, configurable: true });
      return obj;
    }
    return new Map(pairs);
  }
  if (tag === "$b" && typeof body === "string") return Buffer.from(body, "hex");
  if (tag === "$f" && ["nan", "inf", "-inf"].includes(body)) {
    return body === "nan" ? NaN : body === "inf" ? Infinity : -Infinity;
  }
  if (tag === "$u" && body === null) return undefined;
  throw new WireError(`unknown wire tag ${tag}`);
}

function serve(lookup) {
  sendMessage(["ready"]);
  for (;;) {
    let msg;
    try {
      msg = readMessage();
    } catch (e) {
      sendMessage(["error", "bad request"]);
      continue;
    }
    if (msg === null) return;
    const [op, name, args] = Array.isArray(msg) ? msg : [];
    if (op === "has" && Array.isArray(name)) {
      sendMessage(["ok", name.filter((n) => typeof n === "string" && IDENT.test(n) && typeof lookup(n) === "function")]);
      continue;
    }
    const fn = op === "call" && typeof name === "string" && IDENT.test(name) ? lookup(name) : undefined;
    if (typeof fn !== "function") {
      sendMessage(["raise", "ReferenceError", `no function ${String(name).slice(0, 80)} is defined`]);
      continue;
    }
    let result;
    try {
      result = fn(...(Array.isArray(args) ? args : []));
    } catch (e) {
      const err = e instanceof Error ? e : new Error(String(e));
      sendMessage(["raise", String(err.name), String(err.message).slice(0, 500)]);
      continue;
    }
    sendMessage(["ok", result]);
  }
}

const KEYWORDS = new Set(("break case catch class const continue debugger default delete do else export " +
  "extends finally for function if import in instanceof new return super switch this throw try typeof " +
  "var void while with yield let static enum await implements package protected interface private " +
  "public null true false undefined NaN Infinity arguments eval of async get set require module exports").split(" "));

function drive(msg) {
  const key = msg.key;
  const verdict = (kind, detail = "") => record(`VERDICT ${key} ${kind} ${detail}`);
  process.chdir("/tmp");
  let hello;
  try {
    hello = readMessage();
  } catch (e) {
    hello = ["bad"];
  }
  if (hello === null) return verdict("exited", "the candidate exited before its functions could be called");
  if (Array.isArray(hello) && hello[0] === "loadfail") {
    return verdict("failed", `the candidate threw ${String(hello[1]).slice(0, 80)} while loading`);
  }
  if (!Array.isArray(hello) || hello[0] !== "ready") return verdict("failed", "the candidate did not announce itself");

  function call(name, args) {
    try {
      sendMessage(["call", name, args]);
    } catch (e) {
      if (e instanceof WireError) throw new TypeError(`cannot pass to the candidate: ${e.message}`);
      throw new Gone();
    }
    let reply;
    try {
      reply = readMessage();
    } catch (e) {
      throw new WireError(String(e.message));
    }
    if (reply === null) throw new Gone();
    if (Array.isArray(reply) && reply[0] === "ok" && reply.length === 2) return reply[1];
    if (Array.isArray(reply) && reply[0] === "raise" && reply.length === 3) {
      const Cls = [TypeError, RangeError, ReferenceError, SyntaxError, EvalError, URIError].find((c) => c.name === reply[1]) || Error;
      const err = new Cls(String(reply[2]).slice(0, 500));
      if (Cls === Error) err.name = "CandidateError";
      throw err;
    }
    throw new WireError("malformed reply");
  }
  const remote = (name) => {
    const fn = (...args) => call(name, args);
    Object.defineProperty(fn, "name", { value: name });
    return fn;
  };
  const prelude = msg.prelude || "";
  const tests = msg.tests || "";
  // The free names the tests might mean as the candidate's: identifiers of the grader's code
  // that nothing else provides. The candidate says which of them it defines as functions; those
  // are bound in a scope around the prelude and the tests, so whatever the prelude or the tests
  // declare themselves shadows them (a candidate cannot replace a helper the grader relies on).
  const idents = new Set((prelude + "\n" + tests).match(/[A-Za-z_$][\w$]*/g) || []);
  const wanted = [...idents].filter((n) => !KEYWORDS.has(n) && !(n in globalThis)).slice(0, 2000);
  let defined = [];
  try {
    sendMessage(["has", wanted]);
    const reply = readMessage();
    if (reply === null) return verdict("exited", "the candidate exited before its functions could be called");
    defined = Array.isArray(reply) && reply[0] === "ok" && Array.isArray(reply[1]) ? reply[1] : [];
  } catch (e) {
    return verdict("failed", "the candidate sent a malformed reply");
  }
  const bind = (msg.bind || []).filter((n) => IDENT.test(n) && !KEYWORDS.has(n));
  const outer = [...new Set([...defined.filter((n) => wanted.includes(n)), ...bind])];
  const source =
    outer.map((n) => `let ${n} = __remote(${JSON.stringify(n)});`).join("\n") +
    "\nreturn function () {\n" + prelude + "\n" +
    bind.map((n) => `${n} = __remote(${JSON.stringify(n)});`).join("\n") + "\n" + tests + "\n};";
  let body;
  try {
    body = new Function("require", "__remote", source)(require, remote);
  } catch (e) {
    return verdict("driver_error", `the task's grader code failed: ${e.name}`);
  }
  try {
    body();
  } catch (e) {
    if (e instanceof Gone) return verdict("exited", "the candidate exited while a test was calling it");
    if (e instanceof WireError) return verdict("failed", "the candidate sent a malformed reply");
    if (e && e.code === "ERR_ASSERTION") return verdict("failed", "a test assertion failed");
    return verdict("failed", `${e && e.name ? String(e.name).slice(0, 80) : "exception"} in the tests`);
  }
  return verdict("passed");
}

record("READY");
const msg = JSON.parse(fs.readFileSync(ctlFd, "utf8"));
fs.closeSync(ctlFd);
if (msg.mode === "drive") {
  drive(msg);
  process.exit(0);
}
if (msg.mode !== "serve") {
  for (const fd of [linkIn, linkOut]) if (fd >= 0) fs.closeSync(fd);
}
process.chdir("/work");
process.argv = [process.argv[0], "/work/main.js", ...(msg.argv || [])];
if (msg.mode === "serve") {
  try {
    Module._load("/work/main.js", null, true);
  } catch (e) {
    sendMessage(["loadfail", String(e && e.name), String(e && e.message).slice(0, 500)]);
    throw e;
  }
  const lookup = globalThis[LOOKUP];
  delete globalThis[LOOKUP];
  serve(typeof lookup === "function" ? lookup : () => undefined);
  for (const fd of [linkIn, linkOut]) fs.closeSync(fd);
} else {
  Module._load("/work/main.js", null, true);
}
