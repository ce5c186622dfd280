// Warm-sandbox bootstrap for Node: blocks on the control pipe, then runs /work/main.js as the main
// module; with tests (appended to main.js by the host) it reports PASS with the nonce only when
// loading the module returned, i.e. an early process.exit(0) scores nothing.
"use strict";
const fs = require("fs");
const Module = require("module");
const ctlFd = Number(process.argv[1]);
const feedbackFd = Number(process.argv[2]);
const msg = JSON.parse(fs.readFileSync(ctlFd, "utf8"));
fs.closeSync(ctlFd);
// The exact exit status (process.exit(130) is not a signal); death by a signal reports nothing and
// the supervisor falls back to bwrap's status. Reported from the first 'exit' listener, so the
// supervisor still waits for the process to end (later listeners may print).
process.on("exit", (code) => {
  fs.writeSync(feedbackFd, `${msg.nonce} EXIT ${code}\n`);
});
process.chdir("/work");
process.argv = [process.argv[0], "/work/main.js", ...(msg.argv || [])];
Module._load("/work/main.js", null, true);
if (msg.tests !== null && msg.tests !== undefined) {
  fs.writeSync(feedbackFd, `${msg.nonce} PASS \n`);
}
