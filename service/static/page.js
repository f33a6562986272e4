// spcache status page: polls the service's JSON routes; no framework, no build step.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const ERRORS_PAGE = 10, SAMPLES_PAGE = 25, VARIANTS_PAGE = 8;
  const state = { token: null, tokenRequired: null, errorsJob: null, errorsOffset: 0, cache: null,
                  samplesAfter: [""], samplesTicket: 0, sample: null, maxLevel: 8, rates: new Map(),
                  variants: null, variantsOffset: 0, previewTicket: 0 };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
    return node;
  }
  // Each cell carries its column's heading (shown before it on narrow screens).
  function label(table) {
    const heads = [...table.tHead.rows[0].cells].map((th) => th.textContent);
    for (const row of table.tBodies[0].rows) {
      [...row.cells].forEach((td, i) => { if (heads[i] && td.colSpan === 1) td.dataset.label = heads[i]; });
    }
  }
  async function getJSON(url) {
    const r = await fetch(url, { headers: { Accept: "application/json" } });
    if (!r.ok) throw new Error(`${url}: ${r.status} ${(await r.text()).slice(0, 200)}`);
    return r.json();
  }
  const fmtBytes = (n) => n < 1024 ? `${n} B` : n < 1 << 20 ? `${(n / 1024).toFixed(1)} KiB`
    : n < 1 << 30 ? `${(n / 1048576).toFixed(1)} MiB` : `${(n / 1073741824).toFixed(2)} GiB`;
  const fmtParams = (p) => el("span", { class: "params" },
    ...Object.entries(p).map(([k, v]) => el("span", {}, `${k}=${v}`)));
  const shortId = (id) => el("code", { title: id }, id.length > 12 ? `${id.slice(0, 12)}…` : id);
  const fmtTime = (t) => t ? new Date(t * 1000).toLocaleString() : "—";
  function fmtDuration(s) {
    if (s == null || !isFinite(s)) return "—";
    if (s < 60) return `${Math.ceil(s)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  }

  // Rate and ETA: the job's own samples_per_s / eta_s when the service gives them, else
  // measured here from how done+failed moved between polls.
  function rateOf(job) {
    const c = job.counts, finished = c.done + c.failed, now = performance.now() / 1000;
    const prev = state.rates.get(job.id);
    let rate = job.samples_per_s ?? null;
    if (rate == null && prev && now > prev.t) {
      const inst = (finished - prev.finished) / (now - prev.t);
      rate = prev.rate == null ? inst : 0.7 * prev.rate + 0.3 * inst;
    }
    state.rates.set(job.id, { t: now, finished, rate });
    const left = c.pending + c.running;
    const eta = job.eta_s ?? (left === 0 ? 0 : rate > 0 ? left / rate : null);
    return { rate, eta, left };
  }

  function progressBar(job) {
    const c = job.counts, total = job.total ?? (c.done + c.failed + c.pending + c.running);
    const bar = el("div", { class: "bar", role: "img",
      "aria-label": `${c.done} done, ${c.failed} failed, ${c.running} running, ${c.pending} pending of ${total}` });
    for (const k of ["done", "failed", "running"]) {
      if (total > 0 && c[k] > 0) {
        const part = el("span", { class: k });
        part.style.width = `${100 * c[k] / total}%`;  // CSSOM: allowed by the page's CSP
        bar.append(part);
      }
    }
    const pct = total ? Math.floor(100 * (c.done + c.failed) / total) : 100;
    return el("div", {}, bar, el("span", { class: "muted progress-text" },
      `${c.done + c.failed} / ${total} (${pct}%) · ${c.failed} failed · ${c.running} running · ${c.pending} pending`));
  }

  async function refreshJobs() {
    const data = await getJSON("/v1/jobs?limit=50");
    const body = $("jobs").tBodies[0];
    // Rows are rebuilt every poll: keep the keyboard focus on the same button of the same job.
    const focused = document.activeElement?.closest?.("#jobs tbody tr");
    const refocus = focused && [focused.dataset.job,
      [...focused.querySelectorAll("button")].indexOf(document.activeElement)];
    body.replaceChildren();
    $("jobs-empty").hidden = data.jobs.length > 0;
    for (const job of data.jobs) {
      const { rate, eta, left } = rateOf(job);
      const active = job.status === "pending" || job.status === "running";
      const errorsButton = el("button", { type: "button", "aria-controls": "errors-panel" },
        `${job.counts.failed} error${job.counts.failed === 1 ? "" : "s"}`);
      errorsButton.disabled = job.counts.failed === 0;
      errorsButton.onclick = () => { state.errorsJob = job.id; state.errorsOffset = 0; refreshErrors(); };
      const cancel = el("button", { type: "button" }, "Cancel");
      cancel.disabled = !active;
      cancel.onclick = () => cancelJob(job.id);
      body.append(el("tr", { "data-job": job.id, "data-status": job.status },
        el("td", {}, shortId(job.id), el("br"), el("span", { class: "muted" }, fmtTime(job.created))),
        el("td", {}, job.recipe, el("br"), fmtParams(job.params)),
        el("td", {}, el("span", { class: `state ${job.status}` }, job.status.replaceAll("_", " "))),
        el("td", {}, progressBar(job)),
        el("td", { class: "num" }, rate == null ? "—" : `${rate.toFixed(1)}/s`),
        el("td", { class: "num" }, left === 0 ? "done" : fmtDuration(eta)),
        el("td", {}, errorsButton), el("td", {}, cancel)));
    }
    label($("jobs"));
    if (refocus) body.querySelector(`tr[data-job="${refocus[0]}"]`)?.querySelectorAll("button")[refocus[1]]?.focus();
    if (state.errorsJob) await refreshErrors();
  }

  async function refreshErrors() {
    const id = state.errorsJob;
    const job = await getJSON(`/v1/jobs/${encodeURIComponent(id)}?errors_offset=${state.errorsOffset}&errors_limit=${ERRORS_PAGE}`);
    $("errors-panel").hidden = false;
    $("errors-title").textContent = `Errors of job ${id}`;
    const body = $("errors").tBodies[0];
    body.replaceChildren(...job.errors.map((e) => el("tr", {},
      el("td", {}, el("code", {}, e.sample_id)), el("td", {}, el("code", { class: "path" }, e.path)),
      el("td", { class: "num" }, e.attempts), el("td", {}, e.error))));
    const failed = job.counts.failed;
    label($("errors"));
    $("errors-range").textContent = failed ? `${state.errorsOffset + 1}–${state.errorsOffset + job.errors.length} of ${failed}` : "none";
    $("errors-prev").disabled = state.errorsOffset === 0;
    $("errors-next").disabled = state.errorsOffset + ERRORS_PAGE >= failed;
  }

  // Whether the service wants a bearer token for the routes that change things
  // (GET /readyz says; until it has, the page assumes it does).
  async function tokenRequired() {
    if (state.tokenRequired == null) await refreshService();
    return state.tokenRequired ?? true;
  }
  function authHeaders() {
    return state.tokenRequired !== false && state.token ? { Authorization: `Bearer ${state.token}` } : {};
  }
  function tokenRefused() { state.token = null; state.tokenRequired = true; }

  // The token dialog: asks for the bearer token (kept in this tab's memory only) when
  // the service has one, and doubles as the confirmation of a removal (then shown
  // without the token field when the service has none). Resolves true when the user
  // went ahead.
  async function askToken(title, why, okText, always) {
    const needed = await tokenRequired();
    if ((!needed || state.token) && !always) return true;
    const dialog = $("token-dialog");
    $("token-title").textContent = title;
    $("token-why").textContent = why;
    $("token-ok").textContent = okText;
    $("token-field").hidden = !needed;
    $("token").required = needed;
    $("token").value = needed ? state.token ?? "" : "";
    dialog.showModal();
    const answer = await new Promise((ok) => dialog.addEventListener("close", () => ok(dialog.returnValue), { once: true }));
    if (answer !== "ok") return false;
    if (!needed) return true;
    if (!$("token").value) return false;
    state.token = $("token").value;
    return true;
  }

  async function cancelJob(id) {
    if (!await askToken("Token needed", "Cancelling a job needs the service's bearer token.", "Cancel the job")) return;
    const r = await fetch(`/v1/jobs/${encodeURIComponent(id)}`, { method: "DELETE", headers: authHeaders() });
    if (r.status === 401) { tokenRefused(); alert("The token was not accepted."); }
    else if (!r.ok) alert(`Cancel failed: ${r.status} ${await r.text()}`);
    refreshJobs();
  }

  async function refreshCaches() {
    const [list, jobs] = await Promise.all([getJSON("/v1/caches"), getJSON("/v1/jobs?limit=1000")]);
    const created = new Map();
    for (const j of jobs.jobs) created.set(j.fingerprint, Math.min(created.get(j.fingerprint) ?? Infinity, j.created));
    const body = $("caches").tBodies[0];
    const rows = await Promise.all(list.caches.map(async (c) => {
      const detail = await getJSON(`/v1/caches/${c.fingerprint}?limit=0`);
      const open = el("button", { type: "button", "aria-controls": "samples-panel" }, `${c.samples} samples`);
      open.onclick = () => openCache(c);
      // the index's own time (precompute writes one); a job's only before any index
      const when = detail.created ? fmtTime(Date.parse(detail.created) / 1000) : fmtTime(created.get(c.fingerprint));
      const remove = el("button", { type: "button", class: "danger",
        "aria-label": `Remove ${c.recipe} ${c.fingerprint}` }, "Remove");
      remove.onclick = () => removeCache(c, detail);
      return el("tr", { "data-fingerprint": c.fingerprint },
        el("td", {}, shortId(c.fingerprint)), el("td", {}, `${c.recipe} v${c.recipe_version}`),
        el("td", {}, fmtParams(c.params)),
        el("td", { class: "num" }, detail.counts.records), el("td", { class: "num" }, fmtBytes(detail.bytes)),
        el("td", {}, when), el("td", {}, failedCell(detail.failed)), el("td", {}, open), el("td", {}, remove));
    }));
    body.replaceChildren(...rows);
    label($("caches"));
    $("caches-empty").hidden = rows.length > 0;
  }

  // A cache row's failures: the count, and the list (id, path, reason, when) in a
  // disclosure, from every path that computes (precompute, worker, read-through).
  function failedCell(failed) {
    if (!failed || failed.count === 0) return el("span", { class: "muted" }, "none");
    const list = el("ul", { class: "failures" }, ...failed.items.map((f) => el("li", { "data-sample": f.id },
      el("code", {}, f.id), " ", el("code", { class: "path" }, f.path), ": ", f.reason, " ",
      el("span", { class: "muted" }, `(${fmtTime(Date.parse(f.when) / 1000)})`))));
    if (failed.count > failed.items.length) list.append(el("li", { class: "muted" }, `and ${failed.count - failed.items.length} more (spcache stats)`));
    return el("details", { class: "failed" }, el("summary", {}, `${failed.count} failed`), list);
  }

  async function removeCache(c, detail) {
    const what = `${c.recipe} ${c.fingerprint.slice(0, 12)}… (${detail.counts.records} records, ${fmtBytes(detail.bytes)})`;
    if (!await askToken("Remove a fingerprint",
      `Remove ${what}? Its records, index and remembered failures are deleted and its queued samples cancelled. Readers of it get FingerprintRemoved.`,
      "Remove", true)) return;
    const r = await fetch(`/v1/caches/${c.fingerprint}`, { method: "DELETE", headers: authHeaders() });
    if (r.status === 401) { tokenRefused(); $("caches-message").textContent = "The token was not accepted."; return; }
    if (!r.ok) { $("caches-message").textContent = `Remove failed: ${r.status} ${(await r.text()).slice(0, 200)}`; return; }
    const done = await r.json();
    $("caches-message").textContent = `Removed ${c.fingerprint}: ${done.records} records, ${fmtBytes(done.bytes)}.`;
    if (state.cache?.fingerprint === c.fingerprint) { $("samples-panel").hidden = true; $("preview-panel").hidden = true; state.cache = null; }
    refreshCaches();
  }

  function openCache(c) {
    state.cache = c; state.samplesAfter = [""];
    state.maxLevel = c.params.level ?? 8;
    $("samples-panel").hidden = false;
    $("samples-title").textContent = `Samples of ${c.recipe} ${c.fingerprint.slice(0, 12)}…`;
    refreshSamples();
    $("samples-panel").scrollIntoView({ block: "start" });
  }

  async function refreshSamples() {
    const c = state.cache, after = state.samplesAfter[state.samplesAfter.length - 1];
    const q = new URLSearchParams({ prefix: $("prefix").value, after, limit: SAMPLES_PAGE });
    const ticket = ++state.samplesTicket;
    const page = await getJSON(`/v1/caches/${c.fingerprint}/samples?${q}`);
    if (ticket !== state.samplesTicket) return;  // a newer search was sent meanwhile
    const body = $("samples").tBodies[0];
    body.replaceChildren(...page.samples.map((s) => {
      const k = s.variants ?? 1;
      const show = el("button", { type: "button", "aria-controls": "preview-panel" }, k > 1 ? `Show ${k} variants` : "Show");
      show.disabled = !(s.state === "ready" || s.state === "stale" || s.state === "unchecked");
      show.onclick = () => openPreview(s.sample_id, k);
      return el("tr", { "data-sample": s.sample_id }, el("td", {}, el("code", {}, s.sample_id)),
        el("td", {}, el("span", { class: `state ${s.state}` }, s.state)), el("td", {}, s.reason), el("td", {}, show));
    }));
    if (!page.samples.length) body.append(el("tr", {}, el("td", { colspan: 4, class: "muted" }, "No samples match.")));
    label($("samples"));
    state.nextCursor = page.next;
    $("samples-next").disabled = page.next == null;
    $("samples-first").disabled = state.samplesAfter.length === 1;
  }

  // A recipe without an octree (a plugin's own features) has nothing to draw: the panel
  // lists its fields (from GET /v1/recipes) instead of a picture.
  async function recipeFields(name) {
    if (!state.recipes) {
      const listed = await getJSON("/v1/recipes");
      state.recipes = Object.fromEntries(listed.recipes.map((r) => [r.name, r.fields]));
    }
    return state.recipes[name] || null;
  }

  async function openPreview(sampleId, count = 1) {
    state.sample = sampleId; state.variants = null; state.variantsOffset = 0;
    const ticket = ++state.previewTicket;
    let fields = null;
    try { fields = await recipeFields(state.cache.recipe); } catch (e) { console.error(e); }
    const drawable = !fields || (fields.point_hierarchy && fields.pyramid);
    // A sample with several variants: each one's picture side by side, captioned with
    // its variant number and the augmentation it was computed with.
    let variants = null;
    if (drawable && count > 1) {
      const v = await getJSON(`/v1/caches/${state.cache.fingerprint}/variants/${pathOf(sampleId)}`);
      variants = v.variants.length > 1 ? v.variants : null;
    }
    if (ticket !== state.previewTicket) return;  // another sample was opened meanwhile
    state.variants = variants;
    $("preview-controls").hidden = !drawable;
    $("preview-figure").hidden = !drawable || variants != null;
    $("preview-variants").hidden = !drawable || variants == null;
    $("preview-fields").hidden = drawable;
    if (!drawable) {
      $("preview-fields-body").replaceChildren(...Object.entries(fields).map(([name, f]) =>
        el("tr", {}, el("td", {}, name), el("td", {}, f.dtype), el("td", {}, f.shape), el("td", {}, f.meaning))));
      $("preview-panel").hidden = false;
      $("preview-title").textContent = `Fields of ${sampleId}`;
      state.sample = null;
      return;
    }
    const level = $("level");
    level.max = state.maxLevel;
    if (+level.value > state.maxLevel) level.value = state.maxLevel;
    $("preview-panel").hidden = false;
    $("preview-title").textContent = variants ? `Preview of ${sampleId}: ${variants.length} variants` : `Preview of ${sampleId}`;
    drawPreview();
    $("preview-panel").scrollIntoView({ block: "start" });
  }

  // A record id in a URL path: each segment encoded ('#' of a1#v2 too), the slashes kept.
  const pathOf = (id) => id.split("/").map(encodeURIComponent).join("/");
  const previewURL = (recordId, q) => `/v1/caches/${state.cache.fingerprint}/previews/${pathOf(recordId)}?${q}`;
  const fmt = (x, digits) => Number(x).toFixed(digits);

  // What was done to a variant, in words (one line each): its rotation (angle about an
  // axis) and the factor of each axis, from the record's augmentation matrix.
  function augmentationLines(v) {
    if (v.variant === 0) return ["the sample itself, unaugmented"];
    if (v.rotation_deg == null) return ["no augmentation stored"];
    const s = v.scale;
    return [
      v.rotation_deg > 0.05
        ? `rotated ${fmt(v.rotation_deg, 1)}° about (${v.rotation_axis.map((a) => fmt(a, 2)).join(", ")})`
        : "not rotated",
      s.every((f) => Math.abs(f - 1) < 0.0005) ? "not scaled" : `scaled x ${fmt(s[0], 2)} · y ${fmt(s[1], 2)} · z ${fmt(s[2], 2)}`,
    ];
  }

  function drawVariants(q, level, view) {
    const all = state.variants, from = state.variantsOffset;
    const shown = all.slice(from, from + VARIANTS_PAGE);
    const grid = $("preview-variants-grid");
    grid.style.gridTemplateColumns = `repeat(${Math.min(shown.length, 4)}, minmax(0, 1fr))`;  // CSSOM: allowed by the CSP
    grid.replaceChildren(...shown.map((v) => {
      const img = el("img", { class: "variant-preview", "data-variant": v.variant, width: q.get("size"), height: q.get("size"),
        alt: `Variant ${v.variant} of sample ${state.sample}: occupied voxels of octree level ${level}, ${view} view; ${augmentationLines(v).join(", ")}` });
      img.src = previewURL(v.record_id, q);
      return el("figure", { class: "variant", "data-variant": v.variant }, img,
        el("figcaption", {}, el("strong", {}, `variant ${v.variant}`),
          ...augmentationLines(v).flatMap((line) => [el("br"), line])));
    }));
    const paged = all.length > VARIANTS_PAGE;
    $("variants-pager").hidden = !paged;
    $("variants-range").textContent = `variants ${from}–${from + shown.length - 1} of ${all.length}`;
    $("variants-prev").disabled = from === 0;
    $("variants-next").disabled = from + VARIANTS_PAGE >= all.length;
  }

  function drawPreview() {
    if (!state.sample) return;
    const level = $("level").value, view = document.querySelector("input[name=view]:checked").value;
    const queries = $("queries").checked;
    const width = Math.floor($("preview-panel").clientWidth - 4) || 512;
    const columns = state.variants ? Math.min(state.variants.length - state.variantsOffset, VARIANTS_PAGE, 4) : 1;
    const size = Math.min(512, Math.max(128, Math.floor(width / columns) - 12));
    $("level-value").textContent = level;
    const q = new URLSearchParams({ level, view, size, queries });
    if (state.variants) { drawVariants(q, level, view); return; }
    const img = $("preview");
    img.src = previewURL(state.sample, q);
    const text = `Occupied voxels of octree level ${level} of sample ${state.sample}, ${view} view, drawn as shaded cubes`
      + (queries && state.cache.recipe === "spc_query" ? "; query points green where their voxel is occupied, red where not" : "");
    img.alt = text;
    $("preview-caption").textContent = text + ".";
  }

  async function refreshService() {
    try {
      // read on 503 too: token_required is there either way
      const r = await fetch("/readyz", { headers: { Accept: "application/json" } });
      const h = await r.json().catch(() => ({}));
      if (typeof h.token_required === "boolean") state.tokenRequired = h.token_required;
      if (!r.ok) throw new Error(`/readyz: ${r.status} ${(h.problems || [h.status]).join("; ")}`.slice(0, 300));
      const beat = h.worker_heartbeat_age_s;
      const w = h.worker || {};
      const doing = w.state === "stuck"
        ? ` · stuck on sample ${w.sample_id} (${w.stage}) since ${new Date(w.since * 1000).toLocaleTimeString()}, ${w.running_s.toFixed(0)} s of its ${w.limit_s} s time limit`
        : "";
      $("service-line").textContent = `Service ready · worker ${beat == null ? "not seen" : `seen ${beat.toFixed(0)} s ago`}${doing}`;
    } catch (e) { $("service-line").textContent = `Service not ready: ${e.message}`; }
  }

  function loop(fn, ms) {
    const run = async () => { try { await fn(); } catch (e) { console.error(e); } setTimeout(run, ms); };
    run();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("errors-prev").onclick = () => { state.errorsOffset = Math.max(0, state.errorsOffset - ERRORS_PAGE); refreshErrors(); };
    $("errors-next").onclick = () => { state.errorsOffset += ERRORS_PAGE; refreshErrors(); };
    $("samples-search").onsubmit = (e) => { e.preventDefault(); state.samplesAfter = [""]; refreshSamples(); };
    $("samples-next").onclick = () => { state.samplesAfter.push(state.nextCursor); refreshSamples(); };
    $("samples-first").onclick = () => { state.samplesAfter = [""]; refreshSamples(); };
    $("preview-controls").oninput = drawPreview;
    $("variants-prev").onclick = () => { state.variantsOffset = Math.max(0, state.variantsOffset - VARIANTS_PAGE); drawPreview(); };
    $("variants-next").onclick = () => { state.variantsOffset += VARIANTS_PAGE; drawPreview(); };
    $("preview-controls").onsubmit = (e) => e.preventDefault();
    loop(refreshJobs, 1000);
    loop(refreshCaches, 5000);
    loop(refreshService, 5000);
  });
})();
