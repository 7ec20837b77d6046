// Builds the dashboard into ../api/static: index.html (never cached) and assets/ with
// content-hashed names (cached for a year), each with a .gz beside it that the API sends
// to browsers that accept gzip. Fails when the page's JavaScript exceeds its budget.
import * as esbuild from "esbuild";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { gzipSync } from "node:zlib";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.resolve(process.env.TORCHYARD_WEB_OUT || path.join(here, "..", "api", "static"));
const assets = path.join(out, "assets");
const BUDGET_GZIP_BYTES = 150 * 1024;

fs.rmSync(out, { recursive: true, force: true });
fs.mkdirSync(assets, { recursive: true });

const result = await esbuild.build({
  absWorkingDir: here,
  entryPoints: { app: "src/main.js" },
  bundle: true,
  splitting: true,
  format: "esm",
  minify: true,
  target: ["chrome110", "firefox115", "safari16"],
  outdir: assets,
  entryNames: "[name]-[hash]",
  chunkNames: "chunk-[hash]",
  assetNames: "[name]-[hash]",
  metafile: true,
  legalComments: "none",
  logLevel: "warning",
});

const outputs = result.metafile.outputs;
const entry = Object.keys(outputs).find((f) => outputs[f].entryPoint === "src/main.js");
const css = outputs[entry].cssBundle;
const html = fs
  .readFileSync(path.join(here, "index.html"), "utf8")
  .replace("%APP_JS%", path.basename(entry))
  .replace("%APP_CSS%", path.basename(css));
fs.writeFileSync(path.join(out, "index.html"), html);

const sizes = { js: {}, css: {} };
for (const file of Object.keys(outputs)) {
  const body = fs.readFileSync(path.join(here, file));
  const gz = gzipSync(body, { level: 9 });
  fs.writeFileSync(path.join(here, file) + ".gz", gz);
  const kind = file.endsWith(".js") ? "js" : "css";
  sizes[kind][path.basename(file)] = { bytes: body.length, gzip_bytes: gz.length };
}
const jsGzip = Object.values(sizes.js).reduce((n, s) => n + s.gzip_bytes, 0);
const initial = [path.basename(entry), ...outputs[entry].imports.filter((i) => i.kind === "import-statement").map((i) => path.basename(i.path))];
const build = { entry: path.basename(entry), css: path.basename(css), js_gzip_bytes: jsGzip, initial, sizes };
fs.writeFileSync(path.join(out, "build.json"), JSON.stringify(build, null, 2) + "\n");
console.log(`dashboard built into ${path.relative(process.cwd(), out) || "."}: JavaScript ${(jsGzip / 1024).toFixed(1)} KiB gzipped in ${Object.keys(sizes.js).length} files`);
if (jsGzip > BUDGET_GZIP_BYTES) {
  console.error(`the page's JavaScript is over its budget: ${jsGzip} > ${BUDGET_GZIP_BYTES} bytes gzipped`);
  process.exit(1);
}
