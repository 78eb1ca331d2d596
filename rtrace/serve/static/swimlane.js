/* rtrace serve: a step's swimlane on one canvas (docs/serve.md, "A step's timeline").
 *
 * The page embeds the first window's data (#swimdata, JSON); later windows come from the same
 * address with .json (?t0=&t1=&px=&lanes=&lane_px=): the server sends only the lanes asked for
 * and the slices in [t0, t1], narrow ones merged (rtrace/serve/swimlane.py). Here, as uPlot and
 * Perfetto do: one <canvas>, what is off screen culled at each frame, no DOM node per slice; a
 * pointer is resolved by binary search in each row's slices (sorted by start on the server).
 * Names come from the traced program (tool names, workers, servers): they are drawn on the
 * canvas or set with textContent, never as markup, their bidirectional controls made visible.
 */
"use strict";
(function () {
  const root = document.getElementById("swimlane");
  if (!root) return;
  const canvas = document.getElementById("lanes");
  const tip = document.getElementById("swimtip");
  const status = document.getElementById("swimstatus");
  const ctx = canvas.getContext("2d");
  const GUTTER = 210, RULER = 36, HEADER = 22, MIN_SPAN = 0.01, MAX_LANES = 400;  // the server's limit
  const COLOR = {generation: "#4c78a8", tool: "#f58518", reward: "#9d6fb5", wait: "#d4d4d4", mixed: "#8f8f8f",
                 other: "#54a24b"};
  const ROLL = {pass: ["#d5ecd4", "#5a9e58"], fail: ["#f5d5d0", "#c4574a"], unk: ["#e6e6e6", "#9a9a9a"],
                mixed: ["#cfcfcf", "#8f8f8f"]};
  const BAND = {server: "#4c78a8", worker: "#5a9e58"};

  let data = null;           // the window last received
  let rows = [];             // per lane of the window: {roll: [slice ids], kids: Map("sub:depth" -> ids)}
  let laneRow = new Map();   // band * 65536 + lane -> row of the window
  let bands = [];            // from the server: {kind, name, lanes, count}
  let endMs = 0;
  const view = {t0: 0, t1: 1};
  const open = new Set();
  let lanePx = 16, scrollY = 0, W = 800, H = 400, dpr = 1;
  let bandY = [], contentH = 0;
  let hover = null, drag = null, raf = 0, timer = 0, inflight = null, frames = 0, lastQuery = "";
  const frameTimes = [], frameLog = [];  // each frame's drawing time (ms), for the page's own measurements

  // ------------------------------------------------------------------ data
  /* text as a person reads it: each bidirectional control (U+202E ...) written as ⟨U+202E⟩
     (report.js's rule, rtrace._serialize.bidi_visible): a name "\u202egnp.exe" is not "exe.png" */
  const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
  const vis = (text) => text === null ? null : String(text).replace(
    BIDI, (c) => "⟨U+" + c.charCodeAt(0).toString(16).toUpperCase().padStart(4, "0") + "⟩");

  function receive(d) {
    d.names = d.names.map(vis);
    for (const b of d.bands) b.name = vis(b.name);
    d.rollouts.worker = d.rollouts.worker.map(vis);
    d.rollouts.group = d.rollouts.group.map(vis);
    data = d;
    bands = d.bands;
    endMs = d.end_ms;
    const S = d.slices, lanes = d.window.lanes, q = d.tick_ms, base = d.window.t0, n = S.t0.length;
    // times come as whole ticks from the window's start: back to ms from the step's start
    const a = new Float64Array(n), b = new Float64Array(n), tok = new Int32Array(n).fill(-1), srv = new Int32Array(n).fill(-1);
    for (let i = 0; i < n; i++) { a[i] = base + S.t0[i] * q; b[i] = base + S.t1[i] * q; }
    for (let k = 0; k + 2 < S.gen.length; k += 3) {
      if (S.gen[k + 1] !== null) tok[S.gen[k]] = S.gen[k + 1];
      srv[S.gen[k]] = S.gen[k + 2];
    }
    S.t0 = a; S.t1 = b; S.tok = tok; S.srv = srv;
    // the slices by what colour they are drawn in, rollouts first, then calls by depth
    const by = new Map();
    for (let i = 0; i < n; i++) {
      const cat = d.cats[S.cat[i]], depth = S.depth[i];
      let key, fill, stroke = null;
      if (cat === "rollout") {
        const v = S.n[i] > 1 && S.ro[i] < 0 ? "mixed" : verdictOf(S.ro[i], d);
        key = "r" + v; fill = ROLL[v][0]; stroke = ROLL[v][1];
      } else {
        const c = S.n[i] > 1 && cat === "mixed" ? "mixed" : (COLOR[cat] ? cat : "other");
        key = depth + c; fill = COLOR[c];
      }
      let g = by.get(key);
      if (!g) by.set(key, (g = {depth: cat === "rollout" ? -1 : depth, fill, stroke, ids: []}));
      g.ids.push(i);
    }
    d.groups = [...by.values()].sort((x, y) => x.depth - y.depth);
    laneRow = new Map();
    lanes.forEach((bl, r) => laneRow.set(bl[0] * 65536 + bl[1], r));
    rows = lanes.map(() => ({roll: [], kids: new Map()}));
    for (let i = 0; i < S.t0.length; i++) {  // the server emits each row's series in order of start
      const row = rows[S.lane[i]];
      if (S.depth[i] === 0) row.roll.push(i);
      else {
        const key = S.sub[i] + ":" + S.depth[i];
        let list = row.kids.get(key);
        if (!list) row.kids.set(key, (list = []));
        list.push(i);
      }
    }
  }

  function rollout(ro) {
    const R = data.rollouts;
    const out = {};
    for (const k in R) out[k] = R[k][ro];
    return out;
  }

  // ------------------------------------------------------------------ geometry
  const plotW = () => Math.max(10, W - GUTTER);
  const X = (t) => GUTTER + (t - view.t0) / (view.t1 - view.t0) * plotW();
  const T = (x) => view.t0 + (x - GUTTER) / plotW() * (view.t1 - view.t0);

  function layout() {
    bandY = [];
    let y = 0;
    bands.forEach((b, i) => {
      bandY.push(y);
      y += HEADER + (open.has(i) ? b.lanes * lanePx : 0);
    });
    contentH = y;
    const room = Math.max(360, window.innerHeight - 80);  // the canvas fits the window; its lanes scroll inside
    const width = canvas.parentElement.clientWidth;
    const height = Math.max(160, Math.min(RULER + contentH + 2, room));
    if (width !== W || height !== H) {
      W = width; H = height; dpr = window.devicePixelRatio || 1;
      canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr);
      canvas.style.height = H + "px";
    }
    scrollY = Math.max(0, Math.min(scrollY, contentH - (H - RULER)));
  }

  // which band and lane (or header) is at canvas y
  function at(y) {
    const c = y - RULER + scrollY;
    if (y < RULER || c < 0 || c >= contentH) return null;
    let lo = 0, hi = bandY.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (bandY[mid] <= c) lo = mid; else hi = mid - 1;
    }
    const inner = c - bandY[lo] - HEADER;
    if (inner < 0) return {band: lo, header: true};
    const lane = Math.floor(inner / lanePx);
    return {band: lo, lane, top: bandY[lo] + HEADER + lane * lanePx - scrollY + RULER};
  }

  // the slice of ids (sorted by start, not overlapping) under time t: the one holding t, else the
  // nearer neighbour within slack (a slice thinner than a pixel is drawn a pixel wide)
  function find(ids, t, slack) {
    const S = data.slices;
    let lo = 0, hi = ids.length - 1, best = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (S.t0[ids[mid]] <= t) { best = mid; lo = mid + 1; } else hi = mid - 1;
    }
    if (best >= 0 && S.t1[ids[best]] >= t) return ids[best];
    const before = best >= 0 ? t - S.t1[ids[best]] : Infinity;
    const after = best + 1 < ids.length ? S.t0[ids[best + 1]] - t : Infinity;
    if (Math.min(before, after) > slack) return -1;
    return before <= after ? ids[best] : ids[best + 1];
  }

  function pick(x, y) {
    const where = at(y);
    if (!where || x < GUTTER) return where ? {where} : null;
    if (where.header || !data) return {where};
    const r = laneRow.get(where.band * 65536 + where.lane);
    if (r === undefined) return {where};
    const t = T(x), slack = (view.t1 - view.t0) / plotW();
    const S = data.slices, row = rows[r];
    const top = find(row.roll, t, slack);
    if (top < 0) return {where};
    const ro = S.ro[top];
    const subs = ro >= 0 ? data.rollouts.subrows[ro] : 1;
    const sub = Math.min(subs - 1, Math.floor((y - where.top - 1) / Math.max(1, (lanePx - 2) / subs)));
    for (let depth = 8; depth >= 1; depth--) {
      const ids = row.kids.get(sub + ":" + depth);
      if (!ids) continue;
      const k = find(ids, t, slack);
      if (k >= 0) return {where, slice: k};
    }
    return {where, slice: top};
  }

  // ------------------------------------------------------------------ drawing
  function verdictOf(ro, d) {
    if (ro < 0) return "mixed";
    const v = d.rollouts.verdict[ro], r = d.rollouts.reward[ro];
    if (v === "correct") return "pass";
    if (v === "wrong" || v === "error" || v === "truncated" || v === "partial") return "fail";
    if (typeof r === "number") return r > 0 ? "pass" : "fail";
    return "unk";
  }

  // a time in ms, to the precision prec (ms; default: three significant digits)
  function fmtT(ms, prec) {
    const p = prec === undefined ? Math.max(Math.abs(ms) / 100, 1e-3) : prec;
    const digits = (unit) => Math.max(0, Math.min(3, Math.ceil(-Math.log10(p / unit) - 1e-9)));
    if (Math.abs(ms) >= 1000 || p >= 1000) return (ms / 1000).toFixed(digits(1000)) + " s";
    if (Math.abs(ms) >= 1 || p >= 1) return ms.toFixed(digits(1)) + " ms";
    return (ms * 1000).toFixed(0) + " µs";
  }

  function text(str, x, y, maxW) {  // a slice's label: cut by an estimate (no measuring per slice)
    const n = Math.floor(maxW / 6.2);
    if (n < 2) return;
    ctx.fillText(str.length > n ? str.slice(0, n - 1) + "…" : str, x, y);
  }

  function fit(str, x, y, maxW) {  // a band's name: measured, cut to fit; returns its width
    let s = str;
    if (ctx.measureText(s).width > maxW) {
      let lo = 0, hi = s.length;
      while (lo < hi) {
        const mid = (lo + hi + 1) >> 1;
        if (ctx.measureText(str.slice(0, mid) + "…").width <= maxW) lo = mid; else hi = mid - 1;
      }
      s = str.slice(0, lo) + "…";
    }
    ctx.fillText(s, x, y);
    return ctx.measureText(s).width;
  }

  function draw() {
    const started = performance.now();
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, W, H);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    let drawn = 0;
    ctx.save();
    ctx.beginPath();
    ctx.rect(0, RULER, W, H - RULER);
    ctx.clip();
    const bottom = H;
    // bands: header (name, lanes in use over time), lane stripes
    bands.forEach((b, i) => {
      const y = bandY[i] - scrollY + RULER;
      const h = HEADER + (open.has(i) ? b.lanes * lanePx : 0);
      if (y > bottom || y + h < RULER) return;
      ctx.fillStyle = "#f3f4f6";
      ctx.fillRect(0, y, W, HEADER);
      if (open.has(i)) {
        for (let l = 0; l < b.lanes; l++) {
          const ly = y + HEADER + l * lanePx;
          if (ly > bottom) break;
          if (ly + lanePx < RULER) continue;
          if (l % 2) { ctx.fillStyle = "#fafafa"; ctx.fillRect(GUTTER, ly, W - GUTTER, lanePx); }
          if (lanePx >= 12) { ctx.fillStyle = "#8a8a8a"; text("lane " + l, GUTTER - 52, ly + lanePx / 2, 50); }
        }
      }
      const prof = data && data.profiles.values[i];
      if (prof && b.lanes > 0) {
        const w = data.window, bw = (w.t1 - w.t0) / prof.length, scale = (HEADER - 6) / b.lanes;
        ctx.fillStyle = BAND[b.kind] + "99";
        ctx.beginPath();
        for (let k = 0; k < prof.length; k++) {
          if (!prof[k]) continue;
          const x0 = Math.max(GUTTER, X(w.t0 + k * bw)), x1 = Math.min(W, X(w.t0 + (k + 1) * bw));
          if (x1 <= GUTTER || x0 >= W) continue;
          const hh = Math.max(1, prof[k] * scale);
          ctx.rect(x0, y + HEADER - 3 - hh, Math.max(0.5, x1 - x0), hh);
        }
        ctx.fill();
      }
      const count = b.lanes + (b.lanes === 1 ? " lane" : " lanes");
      ctx.font = "11px system-ui, sans-serif";
      const cw = ctx.measureText(count).width;
      ctx.fillStyle = "#666";
      ctx.fillText(count, GUTTER - 6 - cw, y + HEADER / 2);
      ctx.fillStyle = "#222";
      ctx.font = "bold 11px system-ui, sans-serif";
      fit((open.has(i) ? "▾ " : "▸ ") + b.kind + " " + b.name, 6, y + HEADER / 2, GUTTER - 18 - cw);
      ctx.font = "11px system-ui, sans-serif";
      ctx.strokeStyle = "#d9dce1";
      ctx.beginPath(); ctx.moveTo(0, y + 0.5); ctx.lineTo(W, y + 0.5); ctx.stroke();
    });
    // slices: one path per colour (a fill style set once per colour, not per slice), rollouts first,
    // then calls by depth, so that what is inside is drawn over what holds it
    if (data) {
      const S = data.slices, lanes = data.window.lanes, groups = data.groups;
      const labels = [];
      ctx.save();
      ctx.beginPath();
      ctx.rect(GUTTER, RULER, W - GUTTER, H - RULER);
      ctx.clip();
      for (const g of groups) {
        const outline = g.stroke && lanePx > 5 ? [] : null;
        ctx.fillStyle = g.fill;
        ctx.beginPath();
        for (const i of g.ids) {
          const bl = lanes[S.lane[i]], b = bl[0];
          if (!open.has(b)) continue;
          const ly = bandY[b] + HEADER + bl[1] * lanePx - scrollY + RULER;
          if (ly > bottom || ly + lanePx < RULER) continue;
          const x0 = X(S.t0[i]), x1 = X(S.t1[i]);
          if (x1 < GUTTER || x0 > W) continue;
          const left = Math.max(GUTTER - 1, x0), w = Math.max(1, Math.min(W + 1, x1) - left);
          const depth = S.depth[i];
          let y, hgt;
          if (depth === 0) {
            y = ly + 1; hgt = lanePx - 2;
          } else {
            const ro = S.ro[i], subs = ro >= 0 ? data.rollouts.subrows[ro] : 1, sh = (lanePx - 2) / subs;
            const inset = Math.min(sh / 2 - 0.5, (lanePx >= 12 ? 2 : 1) + (depth - 1) * 1.5);
            y = ly + 1 + S.sub[i] * sh + inset; hgt = Math.max(1, sh - 2 * inset);
          }
          ctx.rect(left, y, w, hgt);
          if (outline && w > 3) outline.push(left + 0.5, y + 0.5, w - 1, hgt - 1);
          if (w > 44 && hgt >= 10) labels.push(i, left, y, w, hgt);
          drawn++;
        }
        ctx.fill();
        if (outline && outline.length) {
          ctx.strokeStyle = g.stroke;
          ctx.beginPath();
          for (let k = 0; k < outline.length; k += 4) ctx.rect(outline[k], outline[k + 1], outline[k + 2], outline[k + 3]);
          ctx.stroke();
        }
        // its labels, under what is drawn after it (a rollout's under its calls)
        for (let k = 0; k < labels.length; k += 5) {
          const i = labels[k], ro = S.ro[i], cat = data.cats[S.cat[i]], rolloutBar = S.depth[i] === 0 && cat === "rollout";
          let label;
          if (S.n[i] > 1) label = S.n[i] + " merged";
          else if (rolloutBar && ro >= 0) {
            const R = data.rollouts;
            label = (R.group[ro] !== null ? R.group[ro] : "#" + R.sample_index[ro]) + " · " + R.rollout_n[ro];
          } else label = S.name[i] >= 0 ? data.names[S.name[i]] : cat;
          ctx.fillStyle = rolloutBar ? "#333" : (cat === "wait" ? "#444" : "#fff");
          text(label, labels[k + 1] + 3, labels[k + 2] + labels[k + 4] / 2, labels[k + 3] - 6);
        }
        labels.length = 0;
      }
      ctx.restore();
      // weight updates: a line across every band, the version above it
      ctx.strokeStyle = "#d62728"; ctx.setLineDash([4, 3]);
      for (const e of data.events) {
        const x = Math.round(X(e.t)) + 0.5;
        if (x < GUTTER || x > W) continue;
        ctx.beginPath(); ctx.moveTo(x, RULER - 12); ctx.lineTo(x, H); ctx.stroke();
      }
      ctx.setLineDash([]);
    }
    ctx.restore();
    // the ruler and the gutter's edge
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, RULER);
    ctx.strokeStyle = "#bbb"; ctx.beginPath(); ctx.moveTo(0, RULER - 0.5); ctx.lineTo(W, RULER - 0.5); ctx.stroke();
    ctx.beginPath(); ctx.moveTo(GUTTER - 0.5, 0); ctx.lineTo(GUTTER - 0.5, H); ctx.stroke();
    ctx.strokeStyle = "#ccc";
    const span = view.t1 - view.t0;
    let stepMs = Math.pow(10, Math.floor(Math.log10(span / (plotW() / 90))));
    for (const m of [1, 2, 5, 10]) if (span / (stepMs * m) * 90 <= plotW()) { stepMs *= m; break; }
    ctx.fillStyle = "#555"; ctx.strokeStyle = "#ccc";
    for (let t = Math.ceil(view.t0 / stepMs) * stepMs; t <= view.t1; t += stepMs) {
      const x = Math.round(X(t)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, 16); ctx.lineTo(x, 21); ctx.stroke();
      text(fmtT(t, stepMs), x + 3, 10, 80);
    }
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, GUTTER - 1, RULER - 1);
    ctx.fillStyle = "#555"; text("time from the step's start", 6, 10, GUTTER - 10);
    if (data) {
      ctx.fillStyle = "#d62728"; text("weight updates", 6, RULER - 10, GUTTER - 10);
      ctx.font = "bold 11px system-ui, sans-serif";
      for (const e of data.events) {
        const x = X(e.t);
        if (x >= GUTTER && x <= W) text("v" + (e.version === null ? "?" : e.version), x + 3, RULER - 10, 60);
      }
    }
    const ms = performance.now() - started;
    frames++;
    if (frameTimes.length < 1000) frameTimes.push(ms);
    if (frameLog.length < 1000) frameLog.push([Math.round(ms * 10) / 10, drawn, data ? data.slices.t0.length : 0]);
    root.dataset.frames = String(frames);
    root.dataset.frameMs = ms.toFixed(2);
    root.dataset.drawn = String(drawn);
    if (!root.dataset.firstDrawMs) root.dataset.firstDrawMs = performance.now().toFixed(1);
  }

  function redraw() {
    if (!raf) raf = requestAnimationFrame(() => { raf = 0; draw(); showTip(); schedule(); });
  }

  // ------------------------------------------------------------------ windows from the server
  function visibleLanes(margin) {  // the open lanes on screen, and margin screens above and below
    const out = [];
    const lo = scrollY - margin * (H - RULER), hi = scrollY + (1 + margin) * (H - RULER);
    bands.forEach((b, i) => {
      if (!open.has(i)) return;
      const y0 = bandY[i] + HEADER;
      const first = Math.max(0, Math.floor((lo - y0) / lanePx)), last = Math.min(b.lanes - 1, Math.floor((hi - y0) / lanePx));
      for (let l = first; l <= last; l++) out.push([i, l]);
    });
    return out;
  }

  function covered() {
    if (!data) return false;
    const w = data.window, span = view.t1 - view.t0, res = span / plotW(), had = (w.t1 - w.t0) / w.px;
    if (view.t0 < w.t0 - 1e-9 || view.t1 > w.t1 + 1e-9 || res < had / 1.6 || res > had * 2.5) return false;
    if ((lanePx >= 8) !== w.detail) return false;
    const y0 = scrollY, y1 = scrollY + H - RULER;
    for (let i = 0; i < bands.length; i++) {
      if (!open.has(i)) continue;
      const top = bandY[i] + HEADER;
      for (let l = Math.max(0, Math.floor((y0 - top) / lanePx)); l < bands[i].lanes; l++) {
        if (top + l * lanePx > y1) break;
        if (!laneRow.has(i * 65536 + l)) return false;
      }
    }
    return true;
  }

  function schedule() {
    if (covered()) { setStatus(""); return; }
    if (timer) clearTimeout(timer);
    timer = setTimeout(load, 90);
  }

  function spec(lanes) {  // [[band, lane], ...] -> "b:lo-hi,..."
    const parts = [];
    let cur = null;
    for (const [b, l] of lanes) {
      if (cur && cur[0] === b && cur[2] === l - 1) cur[2] = l;
      else { if (cur) parts.push(cur); cur = [b, l, l]; }
    }
    if (cur) parts.push(cur);
    return parts.map((p) => p[0] + ":" + p[1] + "-" + p[2]).join(",");
  }

  async function load() {
    timer = 0;
    if (inflight) inflight.abort();
    const ctrl = new AbortController();
    inflight = ctrl;
    const span = view.t1 - view.t0;
    let lanes = visibleLanes(0.5);
    if (lanes.length > MAX_LANES) lanes = visibleLanes(0).slice(0, MAX_LANES);
    const q = new URLSearchParams({t0: (view.t0 - span / 4).toFixed(3), t1: (view.t1 + span / 4).toFixed(3),
                                   px: String(Math.round(plotW() * 1.5)), lane_px: String(lanePx), lanes: spec(lanes)});
    if (q.toString() === lastQuery) { inflight = null; return; }  // what can be had is here (lanes past the limit)
    setStatus("loading…");
    try {
      const r = await fetch(root.dataset.src + "?" + q.toString(), {credentials: "same-origin", signal: ctrl.signal});
      if (!r.ok) throw new Error("status " + r.status);
      const d = await r.json();
      if (inflight !== ctrl) return;
      inflight = null;
      lastQuery = q.toString();
      receive(d);
      layout();
      setStatus("");
      redraw();
    } catch (e) {
      if (e.name !== "AbortError") {
        if (inflight === ctrl) inflight = null;
        setStatus("could not load the window: " + e.message);
      }
    }
  }

  function setStatus(extra) {
    const n = data ? data.slices.t0.length : 0;
    const prec = (view.t1 - view.t0) / 100;
    status.textContent = fmtT(view.t0, prec) + " – " + fmtT(view.t1, prec) + " · " +
      n.toLocaleString() + " slices" + (data && data.window.min_px > 2 ? " (narrower than " + data.window.min_px +
      " px merged)" : "") + (extra ? " · " + extra : "");
  }

  // ------------------------------------------------------------------ the tooltip
  function lines(p) {
    const out = [];
    const b = bands[p.where.band];
    if (p.slice === undefined) {
      if (p.where.header) {
        out.push(b.kind + " " + b.name);
        out.push(b.lanes + " lanes; " + b.count.toLocaleString() + (b.kind === "worker" ? " rollouts" : " generations"));
        out.push("click: " + (open.has(p.where.band) ? "close" : "open") + " its lanes");
      }
      return out;
    }
    const S = data.slices, i = p.slice, cat = data.cats[S.cat[i]];
    const d = S.t1[i] - S.t0[i];
    if (S.n[i] > 1) out.push(S.n[i] + " slices merged (" + cat + "): click to zoom in");
    else if (cat === "rollout") out.push("rollout");
    else out.push(S.name[i] >= 0 ? data.names[S.name[i]] : cat);
    out.push(fmtT(S.t0[i], d / 100) + " → " + fmtT(S.t1[i], d / 100) + " (" + fmtT(d) + ")");
    if (S.srv[i] >= 0) out.push("server " + data.names[S.srv[i]]);
    if (S.tok[i] >= 0) out.push(S.tok[i] + " tokens out");
    const ro = S.ro[i];
    if (ro >= 0) {
      const r = rollout(ro);
      out.push("rollout " + r.trace_id + (r.group !== null ? " · group " + r.group : "") +
               (r.rollout_n !== null ? " · #" + r.rollout_n : ""));
      out.push("reward " + (r.reward === null ? "–" : r.reward) + " · " + r.verdict +
               " · " + fmtT(r.t1 - r.t0) + " in all");
      if (r.policy_version !== null) {
        out.push("policy v" + r.policy_version + (r.policy_version_end !== null && r.policy_version_end !==
          r.policy_version ? " → v" + r.policy_version_end : "") + (r.crossed_update ? " (crossed a weight update)" : "") +
          (r.staleness !== null ? " · " + r.staleness + " step(s) stale" : ""));
      }
      out.push("worker " + r.worker + " · lane " + r.lane);
      if (S.n[i] === 1) out.push("click: open the rollout");
    }
    return out;
  }

  function showTip() {
    if (!hover || drag) { tip.hidden = true; return; }
    const p = pick(hover.x, hover.y);
    const text_ = p ? lines(p) : [];
    canvas.style.cursor = p && (p.slice !== undefined || (p.where && p.where.header)) ? "pointer" : "grab";
    if (!text_.length) { tip.hidden = true; return; }
    tip.textContent = text_.join("\n");
    tip.hidden = false;
    const x = Math.min(hover.x + 14, W - tip.offsetWidth - 4), y = hover.y + 16;
    tip.style.left = Math.max(0, x) + "px";
    tip.style.top = (y + tip.offsetHeight > H ? hover.y - tip.offsetHeight - 8 : y) + "px";
  }

  // ------------------------------------------------------------------ moving around
  function zoom(f, center) {
    const c = center === undefined ? (view.t0 + view.t1) / 2 : center;
    const maxSpan = Math.max(endMs * 2, 1);
    let span = Math.min(maxSpan, Math.max(MIN_SPAN, (view.t1 - view.t0) * f));
    const k = (c - view.t0) / (view.t1 - view.t0);
    view.t0 = c - k * span; view.t1 = view.t0 + span;
    redraw();
  }
  function pan(dt) { view.t0 += dt; view.t1 += dt; redraw(); }
  function scroll(dy) {
    scrollY = Math.max(0, Math.min(scrollY + dy, contentH - (H - RULER)));
    redraw();
  }
  function whole() {
    view.t0 = -0.02 * endMs; view.t1 = 1.02 * endMs; scrollY = 0; redraw();
  }
  function toggle(b, state) {
    if (state === undefined ? open.has(b) : !state) open.delete(b); else open.add(b);
    layout(); redraw();
  }
  function activate(p) {
    if (!p) return;
    if (p.slice === undefined) { if (p.where && p.where.header) toggle(p.where.band); return; }
    const S = data.slices, i = p.slice;
    if (S.n[i] > 1) {
      const pad = (S.t1[i] - S.t0[i]) * 0.1 + 0.001;
      view.t0 = S.t0[i] - pad; view.t1 = S.t1[i] + pad; redraw();
    } else if (S.ro[i] >= 0) {
      location.href = data.rollout_base + data.rollouts.trace_id[S.ro[i]];
    }
  }

  canvas.addEventListener("wheel", (ev) => {
    ev.preventDefault();
    const rect = canvas.getBoundingClientRect();
    const x = ev.clientX - rect.left;
    if (ev.shiftKey) scroll(ev.deltaY || ev.deltaX);
    else if (Math.abs(ev.deltaX) > Math.abs(ev.deltaY)) pan(ev.deltaX / plotW() * (view.t1 - view.t0));
    else zoom(Math.exp(ev.deltaY * 0.0015), x >= GUTTER ? T(x) : undefined);
  }, {passive: false});
  canvas.addEventListener("pointerdown", (ev) => {
    const rect = canvas.getBoundingClientRect();
    drag = {x: ev.clientX, y: ev.clientY, t0: view.t0, t1: view.t1, scroll: scrollY, moved: false,
            px: ev.clientX - rect.left, py: ev.clientY - rect.top};
    canvas.setPointerCapture(ev.pointerId);
    canvas.style.cursor = "grabbing";
  });
  canvas.addEventListener("pointermove", (ev) => {
    const rect = canvas.getBoundingClientRect();
    hover = {x: ev.clientX - rect.left, y: ev.clientY - rect.top};
    if (drag) {
      const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
      if (drag.moved) {
        const dt = dx / plotW() * (drag.t1 - drag.t0);
        view.t0 = drag.t0 - dt; view.t1 = drag.t1 - dt;
        scrollY = Math.max(0, Math.min(drag.scroll - dy, contentH - (H - RULER)));
        redraw();
        return;
      }
    }
    showTip();
  });
  canvas.addEventListener("pointerup", (ev) => {
    const d = drag;
    drag = null;
    canvas.releasePointerCapture(ev.pointerId);
    canvas.style.cursor = "grab";
    if (d && !d.moved) activate(pick(d.px, d.py));
  });
  canvas.addEventListener("pointerleave", () => { hover = null; tip.hidden = true; });
  canvas.addEventListener("keydown", (ev) => {
    const span = view.t1 - view.t0;
    const keys = {ArrowLeft: () => pan(-span * 0.15), ArrowRight: () => pan(span * 0.15),
                  ArrowUp: () => scroll(-3 * lanePx), ArrowDown: () => scroll(3 * lanePx),
                  PageUp: () => scroll(-(H - RULER) * 0.9), PageDown: () => scroll((H - RULER) * 0.9),
                  "+": () => zoom(1 / 1.5), "=": () => zoom(1 / 1.5), "-": () => zoom(1.5), "_": () => zoom(1.5),
                  "0": whole, Home: whole, Enter: () => hover && activate(pick(hover.x, hover.y))};
    const fn = keys[ev.key];
    if (fn) { ev.preventDefault(); fn(); }
  });
  root.querySelector(".swimtools").addEventListener("click", (ev) => {
    const act = ev.target.closest("button") && ev.target.closest("button").dataset.act;
    const span = view.t1 - view.t0;
    if (act === "in") zoom(1 / 1.5);
    else if (act === "out") zoom(1.5);
    else if (act === "left") pan(-span * 0.25);
    else if (act === "right") pan(span * 0.25);
    else if (act === "all") whole();
    else if (act === "open") { bands.forEach((_, i) => open.add(i)); layout(); redraw(); }
    else if (act === "close") { open.clear(); layout(); redraw(); }
  });
  document.getElementById("lanepx").addEventListener("change", (ev) => {
    lanePx = Number(ev.target.value) || 16; layout(); redraw();
  });
  if (window.ResizeObserver) new ResizeObserver(() => { layout(); redraw(); }).observe(canvas.parentElement);

  // for tests and for a person at the console: where a slice is drawn, what the view is, frame times
  root.swimlane = {
    view: () => ({t0: view.t0, t1: view.t1, scrollY, lanePx, open: [...open], W, H}),
    frames: () => frameTimes.slice(),
    frameLog: () => frameLog.slice(),
    loading: () => Boolean(inflight) || timer !== 0,
    // the centre of the first drawn slice of rollout traceId (its own bar, or its call named name)
    locate(traceId, name) {
      if (!data) return null;
      const ro = data.rollouts.trace_id.indexOf(traceId);
      if (ro < 0) return null;
      const S = data.slices;
      for (let i = 0; i < S.t0.length; i++) {
        if (S.ro[i] !== ro || S.n[i] !== 1) continue;
        if (name === undefined ? S.depth[i] !== 0 || data.cats[S.cat[i]] !== "rollout"
                               : S.name[i] < 0 || data.names[S.name[i]] !== name) continue;
        const bl = data.window.lanes[S.lane[i]];
        if (!open.has(bl[0]) || bands[bl[0]].kind !== "worker") continue;
        const top = bandY[bl[0]] + HEADER + bl[1] * lanePx - scrollY + RULER;
        const subs = data.rollouts.subrows[ro], sh = (lanePx - 2) / subs;
        const y = S.depth[i] === 0 ? top + lanePx / 2 : top + 1 + S.sub[i] * sh + sh / 2;
        const x = (Math.max(GUTTER, X(S.t0[i])) + Math.min(W, X(S.t1[i]))) / 2;
        if (x >= GUTTER && x <= W && y >= RULER && y <= H) return {x, y};
      }
      return null;
    },
    bandTop: (b) => bandY[b] - scrollY + RULER,
    describe(x, y) {  // what the tooltip says at canvas point (x, y)
      const p = pick(x, y);
      return p ? lines(p) : [];
    },
  };

  // ------------------------------------------------------------------ the first window, embedded
  const first = JSON.parse(document.getElementById("swimdata").textContent);
  receive(first);
  for (const [b] of first.window.lanes) open.add(b);
  view.t0 = first.window.t0; view.t1 = first.window.t1;
  layout();
  draw();
  setStatus("");
  schedule();
})();
