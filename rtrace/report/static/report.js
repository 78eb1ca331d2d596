/* rtrace report: the step viewer (docs/report.md).
 *
 * Reads the block #rtrace-data (JSON built by rtrace/report/data.py, gzip, base64:
 * rtrace/report/page.py; each trajectory an array named by `fields`, texts by index into
 * `strings`) and renders the selected step only, on demand; a conversation is built
 * when it is opened. The state lives in the URL's hash (#step=t3&tab=groups&group=p1, #trace=<id>): links can be shared, the back
 * button works. Texts from the data are only ever set as textContent, their bidirectional
 * controls made visible (vis); the one innerHTML is the SVG that rtrace/report/plots.py escaped.
 *
 * Served by `rtrace serve` (body[data-base] = the run's URL, e.g. /run/run-7), the page
 * holds one step: a trajectory links its full view (tokens, spans) on the server, a prompt
 * its view across every step, and a search that finds nothing here asks the server.
 */
"use strict";
async function rtraceData() {
  const text = atob(document.getElementById("rtrace-data").textContent.trim());
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}
rtraceData().then(function (D) {
  const F = {};
  D.fields.forEach((name, i) => { F[name] = i; });
  const S = D.strings, T = D.trajectories, STEPS = D.steps, FAILURES = D.failures;
  const PAGE = 100;
  const BASE = document.body.dataset.base || null;  // rtrace serve: the run's URL
  const TABS = ["overview", "groups", "failures", "latency", "health", "prompts"];
  const str = (i) => (i === null || i === undefined ? null : S[i]);
  const val = (t, name) => t[F[name]];
  const stepIndex = {};
  STEPS.forEach((st, i) => { stepIndex[st.key] = i; });
  let defaultStep = 0;
  STEPS.forEach((st, i) => { if (!st.validate && st.step !== null) defaultStep = i; });

  // ------------------------------------------------------------------ helpers
  /* text as a person reads it: each bidirectional control (U+202E ...) written as ⟨U+202E⟩,
     so "\u202egnp.exe" is not shown as "exe.png" (rtrace._serialize.bidi_visible, the same rule) */
  const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
  function vis(text) {
    return text.replace(BIDI, (c) => "⟨U+" + c.charCodeAt(0).toString(16).toUpperCase().padStart(4, "0") + "⟩");
  }
  function h(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) {
      const v = attrs[k];
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = vis(String(v));
      else if (k === "svg") e.innerHTML = v;  // only SVG made (and escaped) by plots.py
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : k === "title" ? vis(String(v)) : v);
    }
    for (const c of children.flat(3)) {
      if (c !== null && c !== undefined && c !== false) e.append(c instanceof Node ? c : vis(String(c)));
    }
    return e;
  }
  function strip(text) { return text.indexOf(".") >= 0 ? text.replace(/\.?0+$/, "") : text; }
  /* plain notation, as plots.fmt_number writes it: 1,650 / 1,650.3 / 0.625 / 0.0001234 */
  function num(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "string") return v;  // "NaN", "Infinity": as the JSONL writes them
    if (typeof v === "boolean") return String(v);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    const a = Math.abs(v);
    if (a >= 100) return v.toLocaleString("en-US", {maximumFractionDigits: 1});
    if (a >= 1) return strip(v.toFixed(3));
    if (a < 1e-6) { const [m, e] = v.toExponential(2).split("e"); return strip(m) + "e" + Number(e); }
    return strip(v.toFixed(Math.min(15, 3 - Math.floor(Math.log10(a)))));
  }
  function ms(v) { return v.toLocaleString("en-US", {maximumFractionDigits: 1}) + " ms"; }
  function plural(n, one, many) { return n.toLocaleString("en-US") + " " + (n === 1 ? one : many); }
  function pct(a, b) { return b ? (Math.round(1000 * a / b) / 10) + "%" : "–"; }
  function short(text, n) { return text && text.length > n ? text.slice(0, n) + "…" : (text || ""); }
  /* the end of an answer: where the answer is */
  function tail(text, n) { return text && text.length > n ? "…" + text.slice(text.length - n) : (text || ""); }
  function natural(a, b) { return String(a).localeCompare(String(b), "en", {numeric: true}); }
  function passCell(p) {
    return h("span", {class: p === true ? "pass" : p === false ? "fail" : "unk",
                      text: p === true ? "pass" : p === false ? "fail" : "?"});
  }
  function params() {
    const o = {};
    for (const [k, v] of new URLSearchParams(location.hash.slice(1))) o[k] = v;
    return o;
  }
  /* a link to the state `changes` makes: kept on top of the current one, or alone with keep=false */
  function href(changes, keep) {
    const o = keep === false ? Object.assign({}, changes) : Object.assign(params(), changes);
    for (const k of Object.keys(o)) if (o[k] === null || o[k] === undefined || o[k] === "") delete o[k];
    return "#" + new URLSearchParams(o).toString();
  }
  function go(changes, keep) { location.hash = href(changes, keep); }
  function traceLink(i, text) {
    const id = val(T[i], "trace_id");
    return h("a", {class: "tid", href: href({trace: id}, true), title: id, text: text || id.slice(0, 12)});
  }
  function stepOf(i) { return STEPS[val(T[i], "step")]; }
  function stepRange(si) {
    const st = STEPS[si], out = [];
    for (let i = st.first; i < st.first + st.n; i++) out.push(i);
    return out;
  }
  function answer(i) { return str(val(T[i], "answer")); }
  /* [generation, tools, other] ms, clamped as the step metrics' time_*_frac are */
  function timeSplit(i) {
    const t = T[i], total = val(t, "ms") || 0;
    const gen = Math.min(val(t, "gen_ms"), total), tool = Math.min(val(t, "tool_ms"), total - gen);
    return [gen, tool, Math.max(0, total - gen - tool)];
  }
  function latencyBar(i, max, width) {
    const [gen, tool, other] = timeSplit(i);
    const px = (x) => (max > 0 ? (x / max) * width : 0).toFixed(1) + "px";
    return h("span", {class: "bar", title: split(i)},
             h("i", {class: "g", style: "width:" + px(gen)}), h("i", {class: "t", style: "width:" + px(tool)}),
             h("i", {class: "o", style: "width:" + px(other)}));
  }
  function split(i) {
    const [gen, tool, other] = timeSplit(i);
    return "gen " + ms(gen) + " · tool " + ms(tool) + " · other " + ms(other);
  }
  /* head: [[label, class], ...] */
  function thead(head) {
    return h("thead", null, h("tr", null, head.map((c) => h("th", {class: c[1] || null, text: c[0]}))));
  }
  function table(head, rows, cls) {
    return h("div", {class: "scroll"}, h("table", {class: cls || null}, thead(head), h("tbody", null, rows)));
  }
  /* rows rendered PAGE at a time: a step of 10,000 trajectories stays fast */
  function paged(head, items, row, cls) {
    const body = h("tbody");
    const wrap = h("div", null, h("div", {class: "scroll"}, h("table", {class: cls || null}, thead(head), body)));
    let shown = 0;
    const more = h("button", {class: "more", type: "button", onclick: () => add()});
    function add() {
      const end = Math.min(items.length, shown + PAGE);
      for (; shown < end; shown++) body.append(row(items[shown], shown));
      more.textContent = "show " + Math.min(PAGE, items.length - shown) + " more (" + (items.length - shown) +
        " not shown)";
      more.hidden = shown >= items.length;
    }
    add();
    wrap.append(more);
    return wrap;
  }

  // ------------------------------------------------------------------ indexes (built once, lazily)
  let byTrace = null, byPrompt = null;
  const groupCache = {};
  function findTrace(q) {
    if (!byTrace) {
      byTrace = new Map();
      T.forEach((t, i) => byTrace.set(val(t, "trace_id"), i));
    }
    q = q.toLowerCase();
    if (byTrace.has(q)) return byTrace.get(q);
    if (q.length >= 6) for (const [id, i] of byTrace) if (id.startsWith(q)) return i;
    return -1;
  }
  function groups(si) {  // group name -> trajectory indices, in order of first appearance
    if (!groupCache[si]) {
      const m = new Map();
      for (const i of stepRange(si)) {
        const g = str(val(T[i], "group"));
        if (g === null) continue;
        if (!m.has(g)) m.set(g, []);
        m.get(g).push(i);
      }
      for (const members of m.values()) {
        members.sort((x, y) => (val(T[x], "rollout_n") ?? 1e18) - (val(T[y], "rollout_n") ?? 1e18) ||
                               natural(val(T[x], "trace_id"), val(T[y], "trace_id")));
      }
      groupCache[si] = m;
    }
    return groupCache[si];
  }
  function prompts() {  // prompt name -> trajectory indices, every step
    if (!byPrompt) {
      byPrompt = new Map();
      T.forEach((t, i) => {
        const p = str(val(t, "prompt"));
        if (p === null) return;
        if (!byPrompt.has(p)) byPrompt.set(p, []);
        byPrompt.get(p).push(i);
      });
    }
    return byPrompt;
  }
  function task(i) {  // the question: the first user message
    for (const m of val(T[i], "conv")) if (str(m[0]) === "user") return str(m[1]);
    return null;
  }
  function passRate(items) {
    let p = 0, n = 0;
    for (const i of items) { const v = val(T[i], "pass"); if (v !== null) { n++; p += v ? 1 : 0; } }
    return [p, n];
  }
  function meanReward(items) {
    let s = 0, n = 0;
    for (const i of items) { const r = val(T[i], "reward"); if (typeof r === "number") { s += r; n++; } }
    return n ? s / n : null;
  }

  // ------------------------------------------------------------------ the step
  function header(si, tab) {
    const st = STEPS[si];
    const select = h("select", {"aria-label": "step", onchange: (e) => go({step: e.target.value, tab: tab}, false)},
      STEPS.map((x) => h("option", {value: x.key, selected: x.key === st.key, text: x.label})));
    const prev = si > 0 ? h("a", {href: href({step: STEPS[si - 1].key, tab: tab}, false), text: "← previous"}) : null;
    const next = si < STEPS.length - 1 ? h("a", {href: href({step: STEPS[si + 1].key, tab: tab}, false), text: "next →"})
      : null;
    const tailOnly = st.n - st.sampled;
    return h("div", {class: "stephead"}, h("h2", {id: "step-title", text: st.label}), select, prev, next,
      h("span", {class: "muted", text: plural(st.n, "trajectory", "trajectories") + (tailOnly ? ": " +
        st.sampled.toLocaleString("en-US") + " in the step's sample (the metrics), " + tailOnly +
        " kept for the tail only" : "")}));
  }
  function tabs(si, tab) {
    const st = STEPS[si];
    const nfail = stepRange(si).filter((i) => val(T[i], "fail").length).length;
    const counts = {groups: groups(si).size, failures: nfail, health: st.health.findings.length};
    return h("nav", {class: "tabs"}, TABS.map((name) => h("a", {href: href({step: st.key, tab: name}, false),
      class: name === tab ? "on" : null, "data-tab": name}, name,
      counts[name] !== undefined ? h("span", {class: "n", text: " " + counts[name]}) : null)));
  }

  function overview(si) {
    const st = STEPS[si];
    const box = h("div", {id: "overview"});
    if (!st.metrics.length) box.append(h("p", {class: "muted", text: "No trajectory of this step is in its sample."}));
    const per = Math.ceil(st.metrics.length / 3);
    const grids = [];
    for (let k = 0; k < st.metrics.length; k += per) {
      grids.push(h("table", null, h("tbody", null, st.metrics.slice(k, k + per).map((m) =>
        h("tr", null, h("td", {text: m[0]}), h("td", {"data-metric": m[0], "data-v": String(m[1]), text: m[2]}))))));
    }
    box.append(h("h3", {text: "metrics (the step metrics: docs/metrics.md)"}), h("div", {class: "metrics"}, grids));
    if (st.slowest) {
      const i = findTrace(st.slowest);
      box.append(h("p", null, "slowest trajectory: ", i >= 0 ? traceLink(i, st.slowest) : st.slowest,
        i >= 0 ? " (" + ms(val(T[i], "ms")) + ")" : ""));
    }
    box.append(h("h3", {text: "distributions (the step's sample)"}));
    const hists = h("div", {class: "plots"});
    for (const name of ["reward", "advantage"]) {
      if (st.hist[name]) hists.append(h("div", {class: "hist", "data-hist": name, svg: st.hist[name]}));
    }
    box.append(hists);
    const notes = [];
    if (!st.hist.advantage) notes.push("No advantage: annotate it (rtrace.annotate_batch(..., advantage=...)).");
    if (st.non_finite.reward) notes.push(plural(st.non_finite.reward, "trajectory", "trajectories") + " without a finite reward.");
    notes.forEach((n) => box.append(h("p", {class: "muted", text: n})));
    box.append(h("h3", {text: "zero-variance groups: " + st.zero_var.length + (st.groups_2 ? " of " + st.groups_2 : "") +
      " (all rewards equal: no GRPO signal)"}));
    if (st.zero_var.length) {
      box.append(h("div", {class: "chips", id: "zero-var"}, st.zero_var.map(([name, reward, size]) =>
        h("a", {class: "chip", href: href({step: st.key, tab: "groups", group: name}, false), "data-group": name,
                text: name + " · reward " + num(reward) + " × " + size}))));
    }
    return box;
  }

  function groupList(si, current) {
    const st = STEPS[si];
    const g = groups(si);
    let onlyZero = false;
    const body = h("tbody");
    function fill() {
      body.textContent = "";
      const zero = new Set(st.zero_var.map((z) => z[0]));
      for (const [name, members] of [...g.entries()].sort((a, b) => natural(a[0], b[0]))) {
        if (onlyZero && !zero.has(name)) continue;
        const [p, n] = passRate(members);
        body.append(h("tr", {class: "click" + (name === current ? " sel" : ""), "data-group": name,
                             onclick: () => go({step: st.key, tab: "groups", group: name}, false)},
          h("td", {class: "l", text: name}), h("td", {text: members.length}),
          h("td", {text: num(meanReward(members))}), h("td", {text: n ? p + "/" + n : "–"}),
          h("td", {class: "l"}, zero.has(name) ? h("span", {class: "badge warn", text: "zero variance"}) : "")));
      }
    }
    fill();
    const toggle = h("label", null, h("input", {type: "checkbox", onchange: (e) => { onlyZero = e.target.checked; fill(); }}),
      " zero-variance only");
    return h("div", null, toggle, h("div", {class: "scroll"}, h("table", null, h("thead", null, h("tr", null,
      h("th", {class: "l", text: "group"}), h("th", {text: "rollouts"}), h("th", {text: "reward"}),
      h("th", {text: "pass"}), h("th", {class: "l", text: ""}))), body)));
  }

  function groupView(si, name, p) {
    const st = STEPS[si];
    const members = groups(si).get(name);
    if (!members) return h("p", {class: "muted", text: "Pick a group on the left."});
    const byId = (id) => members.find((i) => val(T[i], "trace_id") === id);
    // default pair: the best and the worst reward, the most telling difference
    const ranked = members.slice().sort((x, y) => (typeof val(T[y], "reward") === "number" ? val(T[y], "reward") : -Infinity) -
                                                  (typeof val(T[x], "reward") === "number" ? val(T[x], "reward") : -Infinity));
    const a = byId(p.a) ?? ranked[0], b = byId(p.b) ?? (ranked.length > 1 ? ranked[ranked.length - 1] : undefined);
    const task0 = task(members[0]);
    const box = h("div", {id: "group", "data-group": name},
      h("h3", null, "group " + name + " · " + members.length + " rollouts · ",
        h("a", {href: href({tab: "prompts", prompt: str(val(T[members[0]], "prompt")), group: null, a: null, b: null}),
                text: "this prompt across steps"})),
      task0 ? h("pre", {class: "text task", text: task0}) : null);
    const cols = h("div", {class: "cols"});
    for (const i of members) {
      const t = T[i], id = val(t, "trace_id");
      const fails = val(t, "fail").map((k) => FAILURES[k]);
      const err = str(val(t, "error"));
      const health = val(t, "health");
      cols.append(h("div", {class: "col" + (i === a ? " a" : "") + (i === b ? " b" : ""), "data-trace": id},
        h("h4", null, h("span", {text: "rollout " + num(val(t, "rollout_n"))}),
          h("span", null, h("a", {href: href({a: id}), class: "chip" + (i === a ? " on" : ""), title: "diff: A", text: "A"}), " ",
            h("a", {href: href({b: id}), class: "chip" + (i === b ? " on" : ""), title: "diff: B", text: "B"}))),
        h("dl", null,
          h("dt", {text: "reward"}), h("dd", {class: "reward", text: num(val(t, "reward"))}),
          h("dt", {text: "advantage"}), h("dd", {class: "advantage", text: num(val(t, "advantage"))}),
          h("dt", {text: "result"}), h("dd", null, passCell(val(t, "pass"))),
          h("dt", {text: "turns / tools"}), h("dd", {text: val(t, "turns") + " / " + val(t, "tools")}),
          h("dt", {text: "latency"}), h("dd", {class: "latency", text: ms(val(t, "ms"))}),
          h("dt", {text: "finish"}), h("dd", {class: "finish", text: str(val(t, "finish")) || "–"}),
          h("dt", {text: "status"}), h("dd", {text: err ? short(err, 80) : fails.length ? fails.join(", ") : "ok"}),
          health && health.length ? [h("dt", {text: "health"}), h("dd", {class: "fail", text: health.map((x) => str(x[0])).join(", ")})] : null),
        h("div", {class: "muted", text: "final answer"}),
        h("pre", {class: "text answer", text: answer(i) ?? "(no assistant message)"}),
        traceLink(i, "conversation →")));
    }
    box.append(cols);
    if (a !== undefined && b !== undefined && a !== b) {
      box.append(h("h3", null, "word diff of the final answers: ",
        h("span", {class: "badge", text: "A: rollout " + num(val(T[a], "rollout_n"))}), " → ",
        h("span", {class: "badge", text: "B: rollout " + num(val(T[b], "rollout_n"))})),
        diffView(answer(a) || "", answer(b) || ""));
    }
    return box;
  }

  /* word-level diff (longest common subsequence over words and the spaces between them) */
  function wordDiff(x, y) {
    const A = x.match(/\s+|[^\s]+/g) || [], B = y.match(/\s+|[^\s]+/g) || [];
    const n = A.length, m = B.length;
    if (n * m > 4e6) return null;
    const L = new Uint32Array((n + 1) * (m + 1)), w = m + 1;
    for (let i = n - 1; i >= 0; i--) {
      for (let j = m - 1; j >= 0; j--) {
        L[i * w + j] = A[i] === B[j] ? L[(i + 1) * w + j + 1] + 1 : Math.max(L[(i + 1) * w + j], L[i * w + j + 1]);
      }
    }
    const out = [];
    const push = (op, text) => {
      if (out.length && out[out.length - 1][0] === op) out[out.length - 1][1] += text; else out.push([op, text]);
    };
    let i = 0, j = 0;
    while (i < n && j < m) {
      if (A[i] === B[j]) { push("=", A[i]); i++; j++; }
      else if (L[(i + 1) * w + j] >= L[i * w + j + 1]) push("-", A[i++]);
      else push("+", B[j++]);
    }
    while (i < n) push("-", A[i++]);
    while (j < m) push("+", B[j++]);
    return out;
  }
  function diffView(x, y) {
    const ops = wordDiff(x, y);
    if (ops === null) return h("p", {class: "muted", text: "The answers are too long to diff here."});
    return h("div", {class: "diff", id: "diff"}, ops.map(([op, text]) =>
      op === "=" ? text : h(op === "-" ? "del" : "ins", {text: text})));
  }

  function failuresView(si) {
    const items = stepRange(si).filter((i) => val(T[i], "fail").length);
    const box = h("div", {id: "failures"});
    if (!items.length) { box.append(h("p", {text: "No failure in this step."})); return box; }
    const counts = FAILURES.map((_, k) => items.filter((i) => val(T[i], "fail").includes(k)).length);
    let filter = -1;
    const holder = h("div");
    const chips = h("div", {class: "chips"});
    function show() {
      for (const c of chips.children) c.classList.toggle("on", Number(c.dataset.k) === filter);
      holder.textContent = "";
      const shown = filter < 0 ? items : items.filter((i) => val(T[i], "fail").includes(filter));
      holder.append(paged([["why", "l"], ["trace", "l"], ["group", "l"], ["rollout"], ["reward"], ["finish", "l"],
        ["error, or the end of the final answer", "l"]], shown, (i) => {
        const t = T[i], err = str(val(t, "error"));
        return h("tr", {class: "click", "data-trace": val(t, "trace_id"),
                        onclick: (e) => { if (!e.target.closest("a")) go({trace: val(t, "trace_id")}); }},
          h("td", {class: "l"}, val(t, "fail").map((k) => [h("span", {class: "badge bad", text: FAILURES[k]}), " "])),
          h("td", {class: "l"}, traceLink(i)),
          h("td", {class: "l"}, str(val(t, "group")) === null ? "–" : h("a", {href: href({step: STEPS[si].key,
            tab: "groups", group: str(val(t, "group"))}, false), text: str(val(t, "group"))})),
          h("td", {text: num(val(t, "rollout_n"))}), h("td", {text: num(val(t, "reward"))}),
          h("td", {class: "l", text: str(val(t, "finish")) || "–"}),
          h("td", {class: "l", text: err ? short(err, 140) : tail(answer(i) || "", 140)}));
      }));
    }
    chips.append(h("button", {class: "chip", type: "button", "data-k": "-1", onclick: () => { filter = -1; show(); }},
      "all " + items.length));
    FAILURES.forEach((name, k) => {
      if (counts[k]) chips.append(h("button", {class: "chip", type: "button", "data-k": String(k),
        onclick: () => { filter = k; show(); }}, name + " " + counts[k]));
    });
    box.append(h("p", {class: "muted", text: items.length + " of " + STEPS[si].n +
      " trajectories failed: error, a generation truncated (finish reason length), partial, outcome correct=false, " +
      "reward ≤ 0 or no reward. Click one for its conversation."}), chips, holder);
    show();
    return box;
  }

  function latencyView(si) {
    const items = stepRange(si).sort((x, y) => val(T[y], "ms") - val(T[x], "ms"));
    const max = items.length ? val(T[items[0]], "ms") : 0;
    const box = h("div", {id: "latency"});
    box.append(h("p", {class: "legend muted"}, "slowest first; time split:", h("i", {style: "background:var(--gen)"}),
      "generation", h("i", {style: "background:var(--tool)"}), "tools", h("i", {style: "background:var(--other)"}), "other"));
    box.append(paged([["#"], ["trace", "l"], ["group", "l"], ["rollout"], ["latency"], ["split", "l"], [""], ["reward"]],
      items, (i, k) => {
        const t = T[i];
        return h("tr", {class: "click", "data-trace": val(t, "trace_id"),
                        onclick: (e) => { if (!e.target.closest("a")) go({trace: val(t, "trace_id")}); }},
          h("td", {text: k + 1}), h("td", {class: "l"}, traceLink(i)), h("td", {class: "l", text: str(val(t, "group")) ?? "–"}),
          h("td", {text: num(val(t, "rollout_n"))}), h("td", {class: "ms", text: ms(val(t, "ms"))}),
          h("td", {class: "l"}, latencyBar(i, max, 240)), h("td", {class: "l muted", text: split(i)}),
          h("td", {text: num(val(t, "reward"))}));
      }));
    return box;
  }

  function healthView(si) {
    const st = STEPS[si], hl = st.health;
    const box = h("div", {id: "health"});
    if (!hl.checked && !hl.findings.length) {
      box.append(h("p", {class: "unknown", text: "No health data for this step: its " + st.n +
        " trajectories were written without health (before rtrace's health checks, or with them off). " +
        "Unknown, not healthy."}));
      return box;
    }
    box.append(h("p", {class: "muted", text: hl.checked + " trajectories of the step's sample checked" +
      (hl.unknown ? ", " + hl.unknown + " without health (unknown, not counted)" : "") +
      ". Rate = trajectories with the check failing / trajectories checked."}));
    const found = {};
    for (const [, c] of hl.findings) found[str(c)] = (found[str(c)] || 0) + 1;
    box.append(table([["check", "l"], ["failing (sample)"], ["rate"], ["findings (all)"]], hl.rates.map(([name, v, text]) => {
      const check = name.slice("health/".length, -"_rate".length);
      return h("tr", {"data-check": check}, h("td", {class: "l", text: check}),
        h("td", {text: hl.failing[check] || 0}), h("td", {"data-metric": name, "data-v": String(v), class: v > 0 ? "fail" : null, text: text}),
        h("td", {text: found[check] || 0}));
    })));
    if (hl.findings.length) {
      box.append(h("h3", {text: "findings"}), paged([["check", "l"], ["detail", "l"], ["trace", "l"], ["group", "l"], ["rollout"]],
        hl.findings, ([i, c, d]) => h("tr", {class: "click", "data-trace": val(T[i], "trace_id"),
                                             onclick: (e) => { if (!e.target.closest("a")) go({trace: val(T[i], "trace_id")}); }},
          h("td", {class: "l", text: str(c)}), h("td", {class: "l", text: str(d)}), h("td", {class: "l"}, traceLink(i)),
          h("td", {class: "l", text: str(val(T[i], "group")) ?? "–"}), h("td", {text: num(val(T[i], "rollout_n"))}))));
    }
    return box;
  }

  function promptList(si) {
    const all = prompts();
    const names = [];
    const seen = new Set();
    for (const i of stepRange(si)) {
      const p = str(val(T[i], "prompt"));
      if (p !== null && !seen.has(p)) { seen.add(p); names.push(p); }
    }
    names.sort(natural);
    const recurring = [...all.values()].some((items) => new Set(items.map((i) => val(T[i], "step"))).size > 1);
    const box = h("div", {id: "prompts"});
    box.append(h("p", {class: "muted", text: "The prompts of this step, each followed across every step it appears in " +
      "(keyed by extra prompt_id, else group_id, else sample_index, as sample_prompts does)."}));
    if (!recurring) {
      box.append(h("p", {class: "unknown", text: "No prompt appears at more than one step: give rollout_context a " +
        "prompt_id (rollout_context(..., prompt_id=\"gsm8k-17\")) to follow prompts across steps."}));
    }
    const rows = names.map((p) => {
      const items = all.get(p);
      const steps = new Set(items.map((i) => val(T[i], "step")));
      const here = items.filter((i) => val(T[i], "step") === si);
      const [ph, nh] = passRate(here);
      return [p, items, steps.size, ph, nh, task(items[0]) || ""];
    });
    const input = h("input", {class: "filter", type: "search", placeholder: "filter by key or question"});
    const holder = h("div");
    function show() {
      const q = input.value.trim().toLowerCase();
      holder.textContent = "";
      holder.append(paged([["prompt", "l"], ["steps"], ["pass here"], ["question", "l"]],
        rows.filter((r) => !q || r[0].toLowerCase().includes(q) || r[5].toLowerCase().includes(q)),
        (r) => h("tr", {class: "click", "data-prompt": r[0], onclick: () => go({tab: "prompts", prompt: r[0]})},
          h("td", {class: "l", text: r[0]}), h("td", {text: r[2]}), h("td", {text: r[4] ? r[3] + "/" + r[4] : "–"}),
          h("td", {class: "l", text: short(r[5], 120)}))));
    }
    input.addEventListener("input", show);
    box.append(input, holder);
    show();
    return box;
  }

  function promptView(name) {
    const items = prompts().get(name);
    const box = h("div", {id: "prompt", "data-prompt": name});
    if (!items) { box.append(h("p", {class: "muted", text: "No prompt named " + name + "."})); return box; }
    box.append(h("h3", null, "prompt " + name + (BASE ? " at this step · " : " across steps · "),
      h("a", {href: href({prompt: null}), text: "all prompts"}),
      BASE ? [" · ", h("a", {href: BASE + "/prompt?" + new URLSearchParams({key: name}).toString(),
                              text: "across every step →"})] : null));
    const q = task(items[0]);
    if (q) box.append(h("pre", {class: "text task", text: q}));
    const bySteps = new Map();
    for (const i of items) {
      const s = val(T[i], "step");
      if (!bySteps.has(s)) bySteps.set(s, []);
      bySteps.get(s).push(i);
    }
    const rows = [...bySteps.entries()].sort((x, y) => x[0] - y[0]).map(([s, its]) => {
      const [p, n] = passRate(its);
      its.sort((x, y) => (val(T[x], "rollout_n") ?? 1e18) - (val(T[y], "rollout_n") ?? 1e18));
      return h("tr", {"data-step": STEPS[s].key},
        h("td", {class: "l"}, h("a", {href: href({step: STEPS[s].key, tab: "prompts", prompt: name}, false), text: STEPS[s].label})),
        h("td", {text: its.length}), h("td", {class: "rate", text: n ? pct(p, n) + " (" + p + "/" + n + ")" : "–"}),
        h("td", {text: num(meanReward(its))}),
        h("td", {class: "l"}, its.map((i) => h("div", {class: "ans"},
          h("a", {class: "tid " + (val(T[i], "pass") === true ? "pass" : val(T[i], "pass") === false ? "fail" : "unk"),
                  href: href({trace: val(T[i], "trace_id")}), title: val(T[i], "trace_id"),
                  text: "r" + num(val(T[i], "rollout_n")) + " · " + num(val(T[i], "reward"))}),
          " ", h("span", {text: tail(answer(i) ?? "(no answer)", 160)})))));
    });
    box.append(table([["step", "l"], ["rollouts"], ["pass rate"], ["reward"], ["answers", "l"]], rows));
    return box;
  }

  function renderStep(si, tab, p) {
    const root = document.getElementById("step");
    root.textContent = "";
    root.append(header(si, tab), tabs(si, tab));
    let body;
    if (tab === "groups") {
      body = h("div", {class: "split", id: "groups"}, h("div", null, groupList(si, p.group)),
        h("div", null, p.group ? groupView(si, p.group, p) : h("p", {class: "muted", text: "Pick a group: its rollouts side by side, " +
          "and a word diff of two final answers (A and B)."})));
    } else if (tab === "failures") body = failuresView(si);
    else if (tab === "latency") body = latencyView(si);
    else if (tab === "health") body = healthView(si);
    else if (tab === "prompts") body = p.prompt ? promptView(p.prompt) : promptList(si);
    else body = overview(si);
    root.append(body);
    for (const tr of document.querySelectorAll("table.run tbody tr")) {
      tr.classList.toggle("sel", tr.dataset.step === STEPS[si].key);
    }
  }

  // ------------------------------------------------------------------ one trajectory
  function renderDrawer(i) {
    const d = document.getElementById("drawer");
    if (i < 0) { d.hidden = true; d.textContent = ""; return; }
    const t = T[i], id = val(t, "trace_id"), st = stepOf(i), meta = {};
    for (const [k, v] of val(t, "meta")) meta[str(k)] = JSON.parse(str(v));
    d.textContent = "";
    const copy = h("button", {class: "copy", type: "button", onclick: () => {
      const done = () => { copy.textContent = "copied"; };
      if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(id).then(done, () => {});
      else {
        const r = document.createRange();
        r.selectNodeContents(d.querySelector("code.tid"));
        const sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(r);
        copy.textContent = "selected: Ctrl+C";
      }
    }, text: "copy"});
    const facts = [
      ["trace id", h("span", null, h("code", {class: "tid", id: "trace-id", text: id}), copy, " ",
        h("a", {href: "#trace=" + id, text: "link"}),
        BASE ? [" · ", h("a", {id: "full-view", href: BASE + "/rollout/" + encodeURIComponent(id),
                               text: "full view: tokens, spans →"})] : null)],
      ["step", h("a", {href: href({step: st.key, tab: "overview"}, false), text: st.label})],
      ["sample / rollout", num(val(t, "sample_index")) + " / " + num(val(t, "rollout_n"))],
      ["group", str(val(t, "group")) === null ? "–" : h("a", {href: href({step: st.key, tab: "groups", group: str(val(t, "group"))}, false),
        text: str(val(t, "group"))})],
      ["prompt", str(val(t, "prompt")) === null ? "–" : h("a", {href: href({step: st.key, tab: "prompts", prompt: str(val(t, "prompt"))}, false),
        text: str(val(t, "prompt"))})],
      ["reward", h("span", {id: "d-reward", text: num(val(t, "reward"))})],
      ["advantage", num(val(t, "advantage"))],
      ["result", passCell(val(t, "pass"))],
      ["failed", val(t, "fail").length ? val(t, "fail").map((k) => FAILURES[k]).join(", ") : "–"],
      ["error", str(val(t, "error")) || "–"],
      ["finish reason", str(val(t, "finish")) || "–"],
      ["turns / tool calls", val(t, "turns") + " / " + val(t, "tools")],
      ["tokens in / out", num(val(t, "tokens_in")) + " / " + num(val(t, "tokens_out"))],
      ["latency", h("span", null, ms(val(t, "ms")) + " ", latencyBar(i, val(t, "ms"), 160), " " + split(i))],
      ["in the sample", val(t, "sampled") ? "yes (counted by the step metrics)" : "no (kept for the tail: " +
        ((meta.kept || []).join(", ") || "?") + ")"],
      ["health", val(t, "health") === null ? h("span", {class: "unk", text: "unknown (written without health)"})
        : val(t, "health").length ? h("span", {class: "fail"}, val(t, "health").map((x) => h("div", {text: str(x[0]) + ": " + str(x[1])})))
          : h("span", {class: "pass", text: "healthy"})],
    ];
    for (const k of Object.keys(meta)) {
      if (k === "kept") continue;
      facts.push([k, typeof meta[k] === "object" ? JSON.stringify(meta[k]) : String(meta[k])]);
    }
    d.append(h("div", {class: "top"}, h("h2", {text: "trajectory"}),
      h("button", {class: "close", type: "button", title: "close (Esc)", onclick: closeDrawer, text: "×"})),
      h("dl", {class: "facts"}, facts.map(([k, v]) => [h("dt", {text: k}), h("dd", null, v)])));
    const spans = val(t, "spans");
    if (spans.length) {
      const total = Math.max(val(t, "ms"), 1e-9);
      d.append(h("h3", {text: "timeline"}), h("div", {class: "timeline"}, spans.map(([kind, name, start, dur, err, fin]) =>
        h("div", {class: "row"}, h("span", {text: (kind === "g" ? "generation" : kind === "t" ? "tool" : kind) +
          (str(name) && str(name) !== kind ? " " + str(name) : "")}),
          h("span", {class: "track"}, h("i", {class: err ? "e" : kind, style: "left:" + (100 * start / total).toFixed(2) + "%;width:" +
            (100 * dur / total).toFixed(2) + "%"})),
          h("span", {text: ms(dur) + (str(fin) ? " " + str(fin) : "")})))));
    }
    d.append(h("h3", {text: "conversation"}));
    const conv = val(t, "conv");
    if (!conv.length) d.append(h("p", {class: "muted", text: "No conversation was captured."}));
    for (const m of conv) {
      const role = str(m[0]);
      const extra = m[2];
      d.append(h("div", {class: "msg " + role},
        h("div", {class: "role", text: role + (role === "tool" && extra !== undefined ? " · " + str(extra) : "")}),
        str(m[1]) ? h("pre", {class: "text", text: str(m[1])}) : null,
        Array.isArray(extra) ? extra.map(([fn, args]) => h("div", {class: "call", text: "→ " + str(fn) + "(" + str(args) + ")"})) : null));
    }
    d.hidden = false;
    d.scrollTop = 0;
  }
  function closeDrawer() { go({trace: null}); }

  // ------------------------------------------------------------------ routing and search
  let shown = null;
  function render() {
    const p = params();
    const ti = p.trace ? findTrace(p.trace) : -1;
    const si = p.step in stepIndex ? stepIndex[p.step] : ti >= 0 ? val(T[ti], "step") : defaultStep;
    const tab = TABS.includes(p.tab) ? p.tab : p.prompt ? "prompts" : p.group ? "groups" : "overview";
    const view = JSON.stringify([si, tab, p.group || "", p.prompt || "", p.a || "", p.b || ""]);
    if (STEPS.length && view !== shown) {
      const first = shown === null;
      renderStep(si, tab, p);
      shown = view;
      // a click in the run's table or a link: bring the step into view (not on opening the page)
      const box = document.getElementById("step");
      if (!first && box.getBoundingClientRect().top > window.innerHeight * 0.6) box.scrollIntoView();
    }
    renderDrawer(ti);
    const msg = document.getElementById("search-msg");
    msg.textContent = p.trace && ti < 0 ? "no trajectory " + p.trace + " in this report" : "";
  }
  function search(q) {
    q = q.trim();
    const msg = document.getElementById("search-msg");
    if (!q) return;
    const ti = findTrace(q);
    if (ti >= 0) { go({trace: val(T[ti], "trace_id")}); return; }
    const cur = params().step in stepIndex ? stepIndex[params().step] : defaultStep;
    const order = [cur].concat(STEPS.map((_, i) => i).filter((i) => i !== cur));
    for (const si of order) {
      if (groups(si).has(q)) { go({step: STEPS[si].key, tab: "groups", group: q}, false); return; }
    }
    if (prompts().has(q)) { go({step: STEPS[cur].key, tab: "prompts", prompt: q}, false); return; }
    if (BASE) { location.href = BASE + "/rollouts?" + new URLSearchParams({q: q}).toString(); return; }
    msg.textContent = "no trace id, group or prompt " + q;
  }

  document.getElementById("search").addEventListener("submit", (e) => { e.preventDefault(); search(document.getElementById("q").value); });
  for (const tr of document.querySelectorAll("table.run tbody tr")) {
    tr.addEventListener("click", (e) => { if (!e.target.closest("a")) go({step: tr.dataset.step, tab: params().tab}, false); });
  }
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && !document.getElementById("drawer").hidden) closeDrawer(); });
  window.addEventListener("hashchange", render);
  render();
  document.body.dataset.ready = "1";
  if (window.performance && performance.mark) performance.mark("rtrace-ready");
}, function (err) {
  const box = document.getElementById("step");
  box.textContent = "This browser could not read the page's data (" + err + "); the tables and plots above " +
    "do not need it. The step viewer needs a browser with DecompressionStream (Chrome 80, Firefox 113, Safari 16.4).";
  document.body.dataset.ready = "error";
});
