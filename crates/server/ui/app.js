// The cordon dashboard. Plain DOM, no framework. Every string that comes from the server goes
// into the page through textContent (never as markup): a sandbox's metadata, its output and
// its audit entries are written by whoever runs code in it.
"use strict";

const KEY_STORAGE = "cordon.apiKey";
const REFRESH_MS = 3000;

// ---------------------------------------------------------------------------------------------
// Small DOM helpers.

const $ = (id) => document.getElementById(id);

// el("td", {className: "num"}, "text", otherNode): children are text or nodes, never markup.
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node[k] = v;
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function bytes(n) {
  if (n === null || n === undefined || isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function age(iso) {
  const s = Math.max(0, Math.floor((Date.now() - Date.parse(iso)) / 1000));
  if (isNaN(s)) return "–";
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

function scalar(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (Array.isArray(v)) return v.length ? v.map(scalar).join(", ") : "none";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

// A definition list of [label, value] pairs.
function kv(node, pairs) {
  clear(node);
  if (!pairs.length) { node.append(el("dd", { className: "muted" }, "none")); return; }
  for (const [k, v] of pairs) node.append(el("dt", {}, k), el("dd", {}, v instanceof Node ? v : scalar(v)));
}

// A table of objects, one column per key seen.
function table(rows, columns) {
  if (!rows || !rows.length) return el("p", { className: "muted" }, "none");
  const cols = columns || [...new Set(rows.flatMap((r) => (r && typeof r === "object" ? Object.keys(r) : ["value"])))];
  return el("div", { className: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, cols.map((c) => el("th", {}, c)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, cols.map((c) => el("td", { className: "mono" }, scalar(r && typeof r === "object" ? r[c] : r))))))));
}

// ---------------------------------------------------------------------------------------------
// The API, with the key from session storage.

let apiKey = sessionStorage.getItem(KEY_STORAGE);

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options) {
  const opts = Object.assign({ cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer" }, options || {});
  opts.headers = Object.assign({ "X-API-KEY": apiKey || "" }, opts.headers || {});
  const r = await fetch(path, opts);
  if (r.status === 401) {
    logout("The server refused the API key.");
    throw new ApiError(401, "unauthorized");
  }
  const text = await r.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (_) { body = text; }
  if (!r.ok) throw new ApiError(r.status, (body && body.message) || r.statusText);
  return body;
}

// ---------------------------------------------------------------------------------------------
// Views.

const VIEWS = ["login-view", "sandboxes-view", "sandbox-view", "templates-view", "pools-view"];
let timer = null;
let current = null; // {view, id}

function show(view) {
  for (const v of VIEWS) $(v).hidden = v !== view;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.id === "nav-" + view.replace("-view", ""));
}

function route() {
  if (timer) { clearInterval(timer); timer = null; }
  if (!apiKey) { current = null; $("nav").hidden = true; show("login-view"); $("login-key").focus(); return; }
  $("nav").hidden = false;
  const hash = location.hash || "#/sandboxes";
  const m = hash.match(/^#\/sandbox\/([a-z0-9]+)$/);
  if (m) {
    if (!current || current.id !== m[1]) closeTerminal();
    current = { view: "sandbox", id: m[1] };
    show("sandbox-view");
    $("sandbox-message").textContent = "";
    loadSandbox(m[1], true);
    timer = setInterval(() => loadSandbox(m[1], false), REFRESH_MS);
    return;
  }
  closeTerminal();
  if (hash === "#/templates") { current = { view: "templates" }; show("templates-view"); loadTemplates(); return; }
  if (hash === "#/pools") { current = { view: "pools" }; show("pools-view"); loadPools(); timer = setInterval(loadPools, REFRESH_MS); return; }
  current = { view: "sandboxes" };
  show("sandboxes-view");
  loadSandboxes();
  timer = setInterval(loadSandboxes, REFRESH_MS);
}

function logout(message) {
  apiKey = null;
  sessionStorage.removeItem(KEY_STORAGE);
  closeTerminal();
  for (const id of ["sandboxes-body", "templates-body", "pools-body", "limits", "metadata", "network", "isolation", "processes", "audit-syscalls", "audit-connections"]) clear($(id));
  $("login-error").textContent = message || "";
  route();
}

async function login(ev) {
  ev.preventDefault();
  const key = $("login-key").value.trim();
  $("login-error").textContent = "";
  if (!key) { $("login-error").textContent = "Paste the API key."; return; }
  // Checked against the API before it is kept: a wrong key shows an error and no data.
  let r;
  try {
    r = await fetch("/sandboxes", { headers: { "X-API-KEY": key }, cache: "no-store", credentials: "omit" });
  } catch (e) { $("login-error").textContent = "Cannot reach the server: " + e.message; return; }
  if (r.status === 401) { $("login-error").textContent = "Invalid API key."; return; }
  if (!r.ok) { $("login-error").textContent = "The server answered " + r.status + "."; return; }
  apiKey = key;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("login-key").value = "";
  if (!location.hash || location.hash === "#/") location.hash = "#/sandboxes";
  route();
}

// The latest metrics sample of each sandbox, fetched alongside the list.
async function latestSample(id) {
  try {
    const now = Math.floor(Date.now() / 1000);
    const samples = await api("/sandboxes/" + id + "/metrics?start=" + (now - 30));
    return samples && samples.length ? samples[samples.length - 1] : null;
  } catch (_) { return null; }
}

async function loadSandboxes() {
  let list;
  try { list = await api("/sandboxes"); } catch (e) { if (e.status !== 401) $("sandboxes-count").textContent = "(" + e.message + ")"; return; }
  if (!current || current.view !== "sandboxes") return;
  const samples = await Promise.all(list.map((s) => (s.state === "running" ? latestSample(s.sandboxID) : null)));
  if (!current || current.view !== "sandboxes") return;
  const body = $("sandboxes-body");
  clear(body);
  list.forEach((s, i) => {
    const m = samples[i];
    const meta = Object.entries(s.metadata || {}).map(([k, v]) => k + "=" + v).join("\n");
    body.append(el("tr", { dataset: { id: s.sandboxID } },
      el("td", {}, el("button", { type: "button", className: "link sandbox-link", onclick: () => { location.hash = "#/sandbox/" + s.sandboxID; } }, s.sandboxID)),
      el("td", {}, s.templateID),
      el("td", {}, s.tier || "–"),
      el("td", {}, s.state),
      el("td", {}, age(s.startedAt)),
      el("td", { className: "num" }, m ? m.cpuUsedPct.toFixed(1) + "% of " + m.cpuCount : "–"),
      el("td", { className: "num" }, m ? bytes(m.memUsed) + " / " + bytes(m.memTotal) : "–"),
      el("td", { className: "mono metadata" }, meta)));
  });
  $("sandboxes-count").textContent = "(" + list.length + ")";
  $("sandboxes-empty").hidden = list.length > 0;
}

// The isolation report, one box per part, in words where the schema allows.
function renderIsolation(r) {
  const box = $("isolation");
  clear(box);
  const section = (title, ...content) => box.append(el("div", { className: "report-section" }, el("h4", {}, title), ...content));
  const pairs = (o) => { const d = el("dl", { className: "kv" }); kv(d, Object.entries(o || {})); return d; };
  section("Summary", pairs({ schema: r.schema, tier: r.tier, "no_new_privs": r.noNewPrivs,
    namespaces: r.namespaces, "masked /proc paths": r.maskedProc && r.maskedProc.length }));
  if (r.runtime) section("Runtime", pairs(r.runtime));
  if (r.cgroup) {
    const c = r.cgroup;
    const cpu = c.cpuQuotaUs && c.cpuPeriodUs ? (c.cpuQuotaUs / c.cpuPeriodUs).toFixed(2) + " cores" : "unlimited";
    section("Cgroup limits", pairs({ memory: bytes(c.memoryBytes), swap: bytes(c.swapBytes), pids: c.pids, cpu: cpu, "TCP memory": c.tcpMemoryBytes === undefined ? undefined : bytes(c.tcpMemoryBytes) }));
  }
  if (r.usage) section("Usage", pairs({ memory: bytes(r.usage.memoryBytes), "peak memory": bytes(r.usage.peakMemoryBytes),
    "CPU time": r.usage.cpuUsec === null || r.usage.cpuUsec === undefined ? "–" : (r.usage.cpuUsec / 1e6).toFixed(2) + " s",
    disk: bytes(r.usage.diskBytes) + " of " + bytes(r.usage.diskTotalBytes) }));
  if (r.idMaps) section("User namespace maps", table([...(r.idMaps.uid || []).map((x) => ({ kind: "uid", inside: x[0], host: x[1], count: x[2] })),
    ...(r.idMaps.gid || []).map((x) => ({ kind: "gid", inside: x[0], host: x[1], count: x[2] }))]));
  if (r.capabilities) {
    const caps = [];
    for (const [who, sets] of Object.entries(r.capabilities)) if (sets && typeof sets === "object") caps.push(Object.assign({ process: who }, sets));
    section("Capabilities", table(caps));
  }
  if (r.seccomp) section("Seccomp", pairs(r.seccomp));
  if (r.landlock) section("Landlock", pairs({ enforced: r.landlock.enforced, abi: r.landlock.abi }), table(r.landlock.rules || []));
  if (r.network) section("Network", pairs(r.network));
  if (r.mounts) section("Mounts", table(r.mounts, ["target", "fstype", "source", "options", "idmapped"]));
  if (r.unknown && Object.keys(r.unknown).length) section("Not known on this tier", pairs(r.unknown));
}

async function loadSandbox(id, first) {
  let d;
  try { d = await api("/sandboxes/" + id); } catch (e) {
    if (e.status === 404) {
      $("sandbox-state").textContent = "gone";
      $("sandbox-message").textContent = "Sandbox " + id + " no longer exists.";
      closeTerminal();
    }
    return;
  }
  if (!current || current.id !== id) return;
  $("sandbox-id").textContent = id;
  $("sandbox-state").textContent = d.state;
  kv($("limits"), [["template", d.templateID], ["tier", d.tier], ["CPUs", d.cpuCount], ["memory", d.memoryMB + " MiB"],
    ["disk", d.diskSizeMB + " MiB"], ["started", d.startedAt + " (" + age(d.startedAt) + " ago)"], ["ends", d.endAt],
    ["lifecycle", d.lifecycle], ["envd", d.envdVersion]]);
  kv($("metadata"), Object.entries(d.metadata || {}));
  const n = d.network || {};
  kv($("network"), [["default", n.default], ["allow out", n.allowOut], ["deny out", n.denyOut],
    ["public traffic", n.allowPublicTraffic], ["header rules", Object.keys(n.rules || {})]]);
  try {
    const a = await api("/sandboxes/" + id + "/audit");
    const syscalls = $("audit-syscalls"), conns = $("audit-connections");
    clear(syscalls); clear(conns);
    syscalls.append(table(a.deniedSyscalls));
    conns.append(table(a.blockedConnections));
  } catch (_) { /* shown on the next refresh */ }
  if (first && d.state === "running") {
    try { renderIsolation(await api("/sandboxes/" + id + "/isolation")); } catch (e) { clear($("isolation")); $("isolation").append(el("p", { className: "error" }, e.message)); }
  }
  if (d.state === "running") loadProcesses(id, d.envdAccessToken);
}

// ---------------------------------------------------------------------------------------------
// Processes: `ps` run through the sandbox's envd on the data plane (Connect protocol, one
// request envelope, a stream of JSON envelopes back).

function envelope(obj) {
  const data = new TextEncoder().encode(JSON.stringify(obj));
  const out = new Uint8Array(5 + data.length);
  new DataView(out.buffer).setUint32(1, data.length);
  out.set(data, 5);
  return out;
}

function b64(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

async function runInSandbox(id, token, cmd, args) {
  const r = await fetch("/process.Process/Start", {
    method: "POST", cache: "no-store", credentials: "omit",
    headers: { "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1", "Connect-Timeout-Ms": "10000",
      "E2b-Sandbox-Id": id, "X-Access-Token": token },
    body: envelope({ process: { cmd: cmd, args: args } }),
  });
  if (!r.ok) throw new Error("envd answered " + r.status);
  const buf = new Uint8Array(await r.arrayBuffer());
  const view = new DataView(buf.buffer);
  const chunks = [];
  for (let off = 0; off + 5 <= buf.length;) {
    const flags = buf[off], len = view.getUint32(off + 1);
    const msg = JSON.parse(new TextDecoder().decode(buf.subarray(off + 5, off + 5 + len)) || "{}");
    off += 5 + len;
    if (flags & 2) { if (msg.error) throw new Error(msg.error.message || msg.error.code); continue; }
    const ev = msg.event || {};
    if (ev.data && ev.data.stdout) chunks.push(b64(ev.data.stdout));
  }
  const all = new Uint8Array(chunks.reduce((n, c) => n + c.length, 0));
  let o = 0;
  for (const c of chunks) { all.set(c, o); o += c.length; }
  return new TextDecoder().decode(all);
}

let processesBusy = false;
async function loadProcesses(id, token) {
  if (processesBusy) return;
  processesBusy = true;
  try {
    const out = await runInSandbox(id, token, "ps", ["-eo", "pid,user,etime,rss,args", "--sort", "pid"]);
    const lines = out.split("\n").filter((l) => l.trim());
    const rows = lines.slice(1).map((l) => {
      const p = l.trim().split(/\s+/);
      return { pid: p[0], user: p[1], elapsed: p[2], rss: bytes(Number(p[3]) * 1024), command: p.slice(4).join(" ") };
    }).filter((r) => !(r.command.startsWith("ps -eo pid,user")));
    if (current && current.id === id) { clear($("processes")); $("processes").append(table(rows, ["pid", "user", "elapsed", "rss", "command"])); }
  } catch (e) {
    if (current && current.id === id) { clear($("processes")); $("processes").append(el("p", { className: "muted" }, "cannot list processes: " + e.message)); }
  } finally { processesBusy = false; }
}

// Kill asks for a second click within a few seconds instead of a dialog.
let killArmed = null;
async function kill() {
  if (!current || current.view !== "sandbox") return;
  const id = current.id, button = $("kill");
  if (!killArmed) {
    button.textContent = "Click again to kill";
    killArmed = setTimeout(() => { killArmed = null; button.textContent = "Kill"; }, 5000);
    return;
  }
  clearTimeout(killArmed); killArmed = null; button.textContent = "Kill";
  try {
    await api("/sandboxes/" + id, { method: "DELETE" });
    closeTerminal();
    location.hash = "#/sandboxes";
  } catch (e) { $("sandbox-message").textContent = "Kill failed: " + e.message; }
}

// ---------------------------------------------------------------------------------------------
// Templates and pools.

async function loadTemplates() {
  let list;
  try { list = await api("/templates"); } catch (_) { return; }
  const body = $("templates-body");
  clear(body);
  for (const t of list) {
    body.append(el("tr", { dataset: { id: t.templateID } },
      el("td", {}, (t.names || t.aliases || []).join(", ")), el("td", { className: "mono" }, t.templateID),
      el("td", {}, t.buildStatus), el("td", { className: "num" }, bytes(t.sizeBytes)), el("td", { className: "num" }, bytes(t.sharedBytes)),
      el("td", { className: "num" }, t.cpuCount), el("td", { className: "num" }, t.memoryMB + " MiB"),
      el("td", { className: "num" }, t.buildCount), el("td", {}, t.createdAt || "–")));
  }
}

async function loadPools() {
  let p;
  try { p = await api("/pools"); } catch (_) { return; }
  $("pools-budget").textContent = "Memory budget " + bytes(p.memoryBudgetBytes) + (p.pools.length ? "" : " · no pools (start the server with --pool TEMPLATE=N)");
  const body = $("pools-body");
  clear(body);
  for (const x of p.pools) {
    body.append(el("tr", {}, el("td", {}, x.templateID), el("td", {}, x.tier), el("td", { className: "num" }, x.size),
      el("td", { className: "num" }, x.ready), el("td", { className: "num" }, x.starting), el("td", { className: "num" }, x.taken),
      el("td", { className: "num" }, x.missed), el("td", { className: "num" }, bytes(x.memoryBytes))));
  }
}

// ---------------------------------------------------------------------------------------------
// The terminal: a screen of text lines with a cursor, enough for a shell's line editing
// (\r, \n, backspace, tab, erase in line and display, cursor moves, clear). Colours and other
// escape sequences are dropped.

const MAX_LINES = 5000;

class Screen {
  constructor(pre) {
    this.pre = pre;
    this.lines = [""];
    this.row = 0; this.col = 0;
    this.cols = 80; this.rows = 24;
    this.state = "text"; this.params = "";
    this.decoder = new TextDecoder();
  }

  write(data) {
    const s = typeof data === "string" ? data : this.decoder.decode(data, { stream: true });
    for (const ch of s) this.put(ch);
    if (this.lines.length > MAX_LINES) {
      const drop = this.lines.length - MAX_LINES;
      this.lines.splice(0, drop);
      this.row = Math.max(0, this.row - drop);
    }
    this.render();
  }

  top() { return Math.max(0, this.lines.length - this.rows); }

  moveTo(row, col) {
    this.row = Math.max(0, row);
    while (this.lines.length <= this.row) this.lines.push("");
    this.col = Math.max(0, col);
  }

  put(ch) {
    const c = ch.codePointAt(0);
    switch (this.state) {
      case "esc":
        if (ch === "[") { this.state = "csi"; this.params = ""; }
        else if (ch === "]") this.state = "osc";
        else if (ch === "(" || ch === ")") this.state = "charset";
        else this.state = "text";
        return;
      case "charset": this.state = "text"; return;
      case "osc":
        if (ch === "\x07") this.state = "text";
        else if (ch === "\x1b") this.state = "osc-esc";
        return;
      case "osc-esc": this.state = "text"; return;
      case "csi":
        if (c >= 0x30 && c <= 0x3f) { this.params += ch; return; }
        if (c >= 0x20 && c <= 0x2f) return;
        this.state = "text";
        this.csi(ch, this.params);
        return;
    }
    if (ch === "\x1b") { this.state = "esc"; return; }
    if (ch === "\r") { this.col = 0; return; }
    if (ch === "\n") { this.moveTo(this.row + 1, this.col); return; }
    if (ch === "\b") { this.col = Math.max(0, this.col - 1); return; }
    if (ch === "\t") { this.col = Math.min(this.cols - 1, (Math.floor(this.col / 8) + 1) * 8); return; }
    if (c < 0x20 || c === 0x7f) return;
    if (this.col >= this.cols) this.moveTo(this.row + 1, 0);
    let line = this.lines[this.row];
    if (line.length < this.col) line = line.padEnd(this.col);
    this.lines[this.row] = line.slice(0, this.col) + ch + line.slice(this.col + 1);
    this.col++;
  }

  csi(final, params) {
    if (params.startsWith("?") || params.startsWith(">")) return; // private modes: nothing to draw
    const args = params.split(";").map((p) => parseInt(p, 10));
    const n = (i, d) => (isNaN(args[i]) || args[i] === 0 ? d : args[i]);
    const line = this.lines[this.row];
    switch (final) {
      case "A": this.moveTo(Math.max(this.top(), this.row - n(0, 1)), this.col); break;
      case "B": this.moveTo(this.row + n(0, 1), this.col); break;
      case "C": this.col = Math.min(this.cols - 1, this.col + n(0, 1)); break;
      case "D": this.col = Math.max(0, this.col - n(0, 1)); break;
      case "G": this.col = n(0, 1) - 1; break;
      case "H": case "f": this.moveTo(this.top() + n(0, 1) - 1, n(1, 1) - 1); break;
      case "K": {
        const mode = isNaN(args[0]) ? 0 : args[0];
        if (mode === 0) this.lines[this.row] = line.slice(0, this.col);
        else if (mode === 1) this.lines[this.row] = " ".repeat(this.col) + line.slice(this.col);
        else this.lines[this.row] = "";
        break;
      }
      case "J": {
        const mode = isNaN(args[0]) ? 0 : args[0];
        if (mode === 0) { this.lines[this.row] = line.slice(0, this.col); this.lines.length = this.row + 1; }
        else { this.lines = [""]; this.row = 0; this.col = 0; }
        break;
      }
      case "P": this.lines[this.row] = line.slice(0, this.col) + line.slice(this.col + n(0, 1)); break;
      case "@": this.lines[this.row] = line.slice(0, this.col) + " ".repeat(n(0, 1)) + line.slice(this.col); break;
      case "X": this.lines[this.row] = (line.slice(0, this.col) + " ".repeat(n(0, 1)) + line.slice(this.col + n(0, 1))).replace(/\s+$/, ""); break;
      default: break; // colours (m), modes (h, l), scroll regions (r): not drawn
    }
  }

  render() {
    const pre = this.pre;
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    clear(pre);
    const before = this.lines.slice(0, this.row);
    const line = this.lines[this.row] || "";
    const after = this.lines.slice(this.row + 1);
    const head = before.length ? before.join("\n") + "\n" : "";
    pre.append(document.createTextNode(head + line.slice(0, this.col)));
    pre.append(el("span", { className: "cursor" }, line[this.col] || " "));
    pre.append(document.createTextNode(line.slice(this.col + 1) + (after.length ? "\n" + after.join("\n") : "")));
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  text() { return this.lines.join("\n"); }
}

let term = null; // {ws, screen, observer, size}

const KEYS = {
  Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b", ArrowUp: "\x1b[A", ArrowDown: "\x1b[B",
  ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D", Home: "\x1b[H", End: "\x1b[F", Delete: "\x1b[3~",
  PageUp: "\x1b[5~", PageDown: "\x1b[6~", Insert: "\x1b[2~",
};

// What a key press sends to the PTY, or null for keys the browser keeps (Ctrl-V pastes).
function keyInput(e) {
  if (e.metaKey) return null;
  if (e.ctrlKey && !e.altKey && e.key.length === 1) {
    const k = e.key.toLowerCase();
    if (k === "v" && e.shiftKey) return null;
    const code = k.charCodeAt(0);
    if (code >= 0x61 && code <= 0x7a) return String.fromCharCode(code - 0x60);
    const extra = { "@": "\x00", "[": "\x1b", "\\": "\x1c", "]": "\x1d", "^": "\x1e", "_": "\x1f", " ": "\x00" };
    return extra[k] || null;
  }
  if (KEYS[e.key]) return KEYS[e.key];
  if (e.key.length === 1 && !e.ctrlKey) return (e.altKey ? "\x1b" : "") + e.key;
  return null;
}

// The element's size in character cells, measured with its own font.
function cellSize(pre) {
  const probe = el("span", { id: "terminal-measure" }, "M".repeat(50));
  pre.append(probe);
  const w = probe.getBoundingClientRect().width / 50, h = probe.getBoundingClientRect().height;
  probe.remove();
  const style = getComputedStyle(pre);
  const innerW = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  const innerH = pre.clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom);
  return { cols: Math.max(10, Math.floor(innerW / (w || 8))), rows: Math.max(4, Math.floor(innerH / (h || 16))) };
}

function send(msg) {
  if (term && term.ws.readyState === WebSocket.OPEN) term.ws.send(JSON.stringify(msg));
}

function openTerminal() {
  if (!current || current.view !== "sandbox" || term) return;
  const id = current.id, pre = $("terminal");
  $("terminal-box").hidden = false;
  clear(pre);
  const screen = new Screen(pre);
  const size = cellSize(pre);
  screen.cols = size.cols; screen.rows = size.rows;
  const ws = new WebSocket((location.protocol === "https:" ? "wss:" : "ws:") + "//" + location.host + "/ui/terminal/" + id);
  ws.binaryType = "arraybuffer";
  term = { ws: ws, screen: screen, size: size, observer: null };
  $("terminal-status").textContent = "connecting…";
  // The key goes in the first message, never in the URL.
  ws.onopen = () => ws.send(JSON.stringify({ type: "auth", key: apiKey, cols: size.cols, rows: size.rows }));
  ws.onmessage = (ev) => {
    if (typeof ev.data !== "string") { screen.write(new Uint8Array(ev.data)); return; }
    let m = {};
    try { m = JSON.parse(ev.data); } catch (_) { return; }
    if (m.type === "ready") { $("terminal-status").textContent = "connected · pid " + m.pid; pre.focus(); }
    else if (m.type === "exit") $("terminal-status").textContent = "the shell ended" + (m.message ? ": " + m.message : "");
    else if (m.type === "error") $("terminal-status").textContent = "error: " + m.message;
  };
  ws.onclose = (ev) => {
    if (term && term.ws === ws) {
      if (!/error|ended/.test($("terminal-status").textContent)) $("terminal-status").textContent = "disconnected" + (ev.reason ? ": " + ev.reason : "");
      if (term.observer) term.observer.disconnect();
      term = null;
    }
  };
  term.observer = new ResizeObserver(() => {
    if (!term || term.ws !== ws) return;
    const s = cellSize(pre);
    if (s.cols !== term.size.cols || s.rows !== term.size.rows) {
      term.size = s; screen.cols = s.cols; screen.rows = s.rows;
      send({ type: "resize", cols: s.cols, rows: s.rows });
    }
  });
  term.observer.observe(pre);
}

function closeTerminal() {
  if (term) {
    const t = term;
    term = null;
    if (t.observer) t.observer.disconnect();
    t.ws.close();
  }
  $("terminal-box").hidden = true;
}

function terminalKey(e) {
  if (!term) return;
  const data = keyInput(e);
  if (data === null) return;
  e.preventDefault();
  send({ type: "input", data: data });
}

function terminalPaste(e) {
  if (!term) return;
  e.preventDefault();
  send({ type: "input", data: (e.clipboardData || window.clipboardData).getData("text") });
}

// ---------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", () => logout(""));
  $("kill").addEventListener("click", kill);
  $("terminal-open").addEventListener("click", openTerminal);
  $("terminal-close").addEventListener("click", closeTerminal);
  $("terminal").addEventListener("keydown", terminalKey);
  $("terminal").addEventListener("paste", terminalPaste);
  window.addEventListener("hashchange", route);
  route();
});

// For tests and the console: the terminal's text as the screen holds it.
window.cordonTerminalText = () => (term ? term.screen.text() : "");
