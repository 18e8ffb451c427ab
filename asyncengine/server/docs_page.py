"""GET /docs: the API's reference as a web page, rendered in the browser from /openapi.json.

vLLM's /docs is FastAPI's Swagger UI, loaded from a CDN; a server on a network without one (or a browser
that blocks it) shows a blank page. This page is self-contained: one HTML document with its own script and
style, nothing fetched but /openapi.json from this server. When the server has --api-key, /openapi.json
answers 401 and the page asks for the key (kept in the tab's sessionStorage, sent as a Bearer token).
Everything the document says is written into the page as text (textContent), never as HTML.
"""

from __future__ import annotations

DOCS_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>API reference</title>
<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 62rem; padding: 1rem 1.5rem; color: #1d1d1f; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; }
.op { border: 1px solid #d0d7de; border-radius: 6px; margin: .6rem 0; }
.op > summary { cursor: pointer; padding: .5rem .7rem; list-style: none; }
.method { display: inline-block; min-width: 3.6rem; font-weight: 600; font-family: monospace; }
.get { color: #0a7d32; } .post { color: #0550ae; } .put, .patch { color: #9a6700; } .delete { color: #cf222e; }
.path { font-family: monospace; font-weight: 600; margin-right: .8rem; }
.body { padding: .2rem 1rem 1rem; border-top: 1px solid #d0d7de; }
table { border-collapse: collapse; width: 100%; font-size: .92rem; }
td, th { text-align: left; vertical-align: top; border-bottom: 1px solid #eaeef2; padding: .25rem .4rem; }
code, pre { font-family: ui-monospace, monospace; font-size: .88rem; }
pre { background: #f6f8fa; padding: .6rem; overflow-x: auto; }
.muted { color: #57606a; } #key { display: none; margin: 1rem 0; } #error { color: #cf222e; }
</style>
</head>
<body>
<h1 id="title">API reference</h1>
<p class="muted" id="subtitle">Loading <a href="openapi.json">/openapi.json</a>...</p>
<form id="key">This server asks for an API key to read its contract:
  <input id="key-value" type="password" size="32" autocomplete="off"> <button>Load</button></form>
<p id="error"></p>
<div id="operations"></div>
<script>
"use strict";
const base = location.pathname.replace(/docs\\/?$/, "");
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child);  // strings become text nodes: never parsed as HTML
  return node;
};

function resolve(doc, schema) {
  while (schema && schema.$ref) schema = schema.$ref.split("/").slice(1).reduce((node, key) => node[key], doc);
  return schema || {};
}

function typeName(doc, schema, depth = 0) {
  if (!schema) return "any";
  if (schema.$ref) return schema.$ref.split("/").pop();
  if (depth > 4) return "...";
  for (const key of ["anyOf", "oneOf"]) {
    if (schema[key]) return schema[key].map(s => typeName(doc, s, depth + 1)).join(" | ");
  }
  if ("const" in schema) return JSON.stringify(schema.const);
  if (schema.enum) return schema.enum.map(v => JSON.stringify(v)).join(" | ");
  if (schema.type === "array") {
    const item = typeName(doc, schema.items, depth + 1);
    return (item.includes(" | ") ? `(${item})` : item) + "[]";
  }
  return schema.type || "object";
}

function bounds(schema) {
  const said = [];
  for (const [key, words] of [["minimum", ">="], ["maximum", "<="], ["exclusiveMinimum", ">"],
                              ["exclusiveMaximum", "<"], ["minLength", "length >="], ["maxLength", "length <="],
                              ["minItems", "items >="], ["maxItems", "items <="]]) {
    if (key in schema) said.push(`${words} ${schema[key]}`);
  }
  if ("default" in schema) said.push(`default ${JSON.stringify(schema.default)}`);
  return said.join(", ");
}

function fieldsTable(doc, schema) {
  const object = resolve(doc, schema);
  const properties = object.properties || {};
  if (!Object.keys(properties).length) return el("p", {}, el("code", {}, typeName(doc, schema)));
  const required = new Set(object.required || []);
  const rows = Object.entries(properties).map(([name, field]) => el("tr", {},
    el("td", {}, el("code", {}, name), required.has(name) ? " *" : ""),
    el("td", {}, el("code", {}, typeName(doc, field))),
    el("td", {}, [field.description || resolve(doc, field).description || "", bounds(field)]
                 .filter(Boolean).join(" "))));
  return el("table", {}, el("tr", {}, el("th", {}, "field"), el("th", {}, "type"), el("th", {}, "notes")), ...rows);
}

function operation(doc, path, method, op) {
  const body = el("div", {class: "body"});
  const request = op.requestBody && op.requestBody.content["application/json"];
  if (request) {
    body.append(el("h4", {}, "Request body (* required)"), fieldsTable(doc, request.schema));
    for (const example of Object.values(request.examples || {})) {
      body.append(el("pre", {}, JSON.stringify(example.value, null, 2)));
    }
  }
  body.append(el("h4", {}, "Responses"));
  for (const [status, answer] of Object.entries(op.responses || {})) {
    const types = Object.keys(answer.content || {});
    body.append(el("p", {}, el("strong", {}, status), " " + (answer.description || ""),
                   types.length ? el("span", {class: "muted"}, " (" + types.join(", ") + ")") : ""));
    const json = (answer.content || {})["application/json"];
    if (status === "200" && json) body.append(fieldsTable(doc, json.schema));
  }
  if (op.security) body.append(el("p", {class: "muted"}, "Needs Authorization: Bearer KEY."));
  return el("details", {class: "op"}, el("summary", {},
    el("span", {class: "method " + method}, method.toUpperCase()), el("span", {class: "path"}, path),
    el("span", {class: "muted"}, op.summary || "")), body);
}

function render(doc) {
  document.getElementById("title").textContent = `${doc.info.title} ${doc.info.version}`;
  document.getElementById("subtitle").textContent = doc.info.description || "";
  const list = document.getElementById("operations");
  list.replaceChildren();
  for (const [path, methods] of Object.entries(doc.paths).sort()) {
    for (const [method, op] of Object.entries(methods)) list.append(operation(doc, path, method, op));
  }
}

async function load() {
  const key = sessionStorage.getItem("api-key");
  const response = await fetch(base + "openapi.json", {headers: key ? {Authorization: "Bearer " + key} : {}});
  const form = document.getElementById("key");
  if (response.status === 401) {
    form.style.display = "block";
    document.getElementById("error").textContent = key ? "That key was refused." : "";
    return;
  }
  if (!response.ok) throw new Error(`/openapi.json answered ${response.status}`);
  form.style.display = "none";
  document.getElementById("error").textContent = "";
  render(await response.json());
}

document.getElementById("key").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem("api-key", document.getElementById("key-value").value);
  load().catch(error => { document.getElementById("error").textContent = String(error); });
});
load().catch(error => { document.getElementById("error").textContent = String(error); });
</script>
</body>
</html>
"""
