// The trajectory viewer's script (kpipe.report.viewer inlines it into index.html).
// Model and task text reaches the page only as (a) index JSON written with textContent and
// (b) detail HTML that build_viewer escaped; nothing here builds HTML from strings.
"use strict";
const INDEX = JSON.parse(document.getElementById("kpipe-index").textContent);
const ROWS_PER_PAGE = 100;
const loaded = new Map();
const waiting = new Map();
let shown = INDEX;
let listPage = 0;
let selected = null;

window.kpipeViewer = {
  addPage(fileNumber, packed) {
    unpack(packed).then((data) => {
      loaded.set(fileNumber, data);
      for (const callback of waiting.get(fileNumber) || []) callback(data);
      waiting.delete(fileNumber);
    }, (error) => message("Could not unpack data file " + fileNumber + " (a browser with DecompressionStream "
                          + "is needed: Chrome 80+, Firefox 113+, Safari 16.4+): " + error));
  },
};

async function unpack(packed) {
  const bytes = Uint8Array.from(atob(packed), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

function loadFile(fileNumber, callback) {
  if (loaded.has(fileNumber)) return callback(loaded.get(fileNumber));
  if (waiting.has(fileNumber)) return waiting.get(fileNumber).push(callback);
  waiting.set(fileNumber, [callback]);
  const script = document.createElement("script");
  script.src = "data/page-" + String(fileNumber).padStart(4, "0") + ".js";
  script.onerror = () => {
    waiting.delete(fileNumber);
    message("Could not load " + script.src + ": is the data/ folder next to index.html?");
  };
  document.head.appendChild(script);
}

function message(text) {
  const detail = document.getElementById("detail");
  detail.replaceChildren();
  const p = document.createElement("p");
  p.className = "note";
  p.textContent = text;
  detail.appendChild(p);
}

function fmt(value) {
  if (value === null || value === undefined) return "\u2014";
  return typeof value === "number" && !Number.isInteger(value) ? +value.toPrecision(3) : value;
}

const selects = Array.from(document.querySelectorAll("select[data-field]"));
for (const select of selects) {
  const field = select.dataset.field;
  const values = new Set();
  for (const e of INDEX) for (const v of [].concat(e[field])) values.add(v);
  const all = document.createElement("option");
  all.value = "";
  all.textContent = "all";
  select.appendChild(all);
  for (const v of Array.from(values).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0))) {
    const option = document.createElement("option");
    option.value = String(v);
    option.textContent = String(v);
    select.appendChild(option);
  }
  select.addEventListener("change", update);
}
document.getElementById("task-filter").addEventListener("input", update);
document.getElementById("sort").addEventListener("change", update);
document.getElementById("prev").addEventListener("click", () => { listPage -= 1; renderList(); });
document.getElementById("next").addEventListener("click", () => { listPage += 1; renderList(); });

const descending = (key) => (a, b) => {
  const x = key(a), y = key(b);
  if (x === y) return a.id - b.id;
  if (x === null) return 1;
  if (y === null) return -1;
  return y - x;
};
const ORDERS = {
  default: (a, b) => a.id - b.id,
  best_speedup: descending((e) => e.best_speedup),
  hacked: descending((e) => e.hacked_turns),
  reward_change: descending((e) => (e.reward_change === null ? null : Math.abs(e.reward_change))),
};

function update() {
  const wanted = selects.filter((s) => s.value !== "").map((s) => [s.dataset.field, s.value]);
  const text = document.getElementById("task-filter").value.toLowerCase();
  shown = INDEX.filter((e) => wanted.every(([field, value]) => [].concat(e[field]).some((v) => String(v) === value))
    && (!text || e.task.toLowerCase().includes(text) || (e.name || "").toLowerCase().includes(text)));
  shown.sort(ORDERS[document.getElementById("sort").value]);
  listPage = 0;
  renderList();
}

function renderList() {
  const pages = Math.max(1, Math.ceil(shown.length / ROWS_PER_PAGE));
  listPage = Math.min(Math.max(listPage, 0), pages - 1);
  const body = document.getElementById("rows");
  body.replaceChildren();
  for (const e of shown.slice(listPage * ROWS_PER_PAGE, (listPage + 1) * ROWS_PER_PAGE)) {
    const row = document.createElement("tr");
    if (e.id === selected) row.className = "selected";
    for (const name of [e.stage, e.run]) row.appendChild(nameCell(name));
    row.appendChild(numberCell(e.iteration));
    for (const name of [e.model, e.task]) row.appendChild(nameCell(name));
    for (const value of [e.sample, e.turns]) row.appendChild(numberCell(value));
    row.appendChild(nameCell(e.status));
    for (const value of [e.best_speedup, e.hacked_turns, e.reward_change, e.reward]) row.appendChild(numberCell(value));
    row.addEventListener("click", () => openTrajectory(e.id));
    body.appendChild(row);
  }
  document.getElementById("shown").textContent = shown.length + " of " + INDEX.length + " trajectories";
  document.getElementById("page").textContent = "page " + (listPage + 1) + " / " + pages;
  showScrollHint();
}

// A name (stage, run, model, task, status) may wrap only after a separator: "tritonforge_|released",
// never "coldst|art"
const NAME_PARTS = /(?<=[_\-@\/.=])/;

function nameCell(value) {
  const cell = document.createElement("td");
  String(fmt(value)).split(NAME_PARTS).forEach((part, index) => {
    if (index > 0) cell.appendChild(document.createElement("wbr"));
    cell.appendChild(document.createTextNode(part));
  });
  return cell;
}

function numberCell(value) {
  const cell = document.createElement("td");
  cell.className = "number";
  cell.textContent = fmt(value);
  return cell;
}

// a list wider than its box says so above it: its right-hand columns are a sideways scroll away
function showScrollHint() {
  const box = document.getElementById("list");
  document.getElementById("list-hint").hidden = box.scrollWidth <= box.clientWidth;
}

window.addEventListener("resize", showScrollHint);

function openTrajectory(id) {
  const entry = INDEX[id];
  if (!entry) return;
  selected = id;
  history.replaceState(null, "", "#t=" + id);
  renderList();
  message("Loading\u2026");
  loadFile(entry.file, (data) => {
    if (selected !== id) return;
    const detail = document.getElementById("detail");
    const trajectory = data.trajectories[id];
    const reference = "<details><summary>Reference (PyTorch)</summary>" + data.references[trajectory.task]
      + "</details>";
    detail.innerHTML = trajectory.head + reference + trajectory.turns;  // all escaped at build time
  });
}

update();
const linked = /^#t=(\d+)$/.exec(location.hash);
if (linked) openTrajectory(Number(linked[1]));
