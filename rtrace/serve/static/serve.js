/* rtrace serve: the pages' live updates and small conveniences (docs/serve.md).
 *
 * Every page works without this script (links and GET forms). With it:
 * - the page follows its run: it polls /-/state.json and, when the run's version changes
 *   (new files: a new step, more rollouts), loads the same address again and swaps its
 *   <main> for the new one (not while a field of the page has the focus); the step viewer
 *   (a script of its own, body without data-swap) gets a note with a reload link instead;
 * - the column chooser applies on a click.
 * The new <main> is this server's own HTML, in which every text was escaped on the server;
 * no text from the data is ever set as markup here.
 */
"use strict";
(function () {
  const body = document.body;
  const colform = document.getElementById("colform");
  if (colform) colform.addEventListener("change", () => colform.submit());
  const run = body.dataset.run;
  if (!run) return;
  let version = Number(body.dataset.version);
  let busy = false;
  const live = () => document.getElementById("live");

  function mark(ok) {
    const el = live();
    if (!el) return;
    el.classList.toggle("off", !ok);
    el.title = ok ? "following the run; checked at " + new Date().toLocaleTimeString()
                  : "cannot reach the server";
  }
  async function swap(v) {
    const focused = document.activeElement;
    if (focused && focused !== body && focused.closest("main") && /^(INPUT|SELECT|TEXTAREA)$/.test(focused.tagName)) {
      return;  // the person is typing: next time
    }
    const r = await fetch(location.href, {cache: "no-store", credentials: "same-origin", headers: {Accept: "text/html"}});
    if (!r.ok) return;
    const doc = new DOMParser().parseFromString(await r.text(), "text/html");
    const fresh = doc.getElementById("main");
    const main = document.getElementById("main");
    if (!fresh || !main) return;
    const open = new Set([...main.querySelectorAll("details[open]")].map((d) => d.className));
    const y = window.scrollY;
    main.replaceChildren(...fresh.childNodes);
    for (const d of main.querySelectorAll("details")) if (open.has(d.className)) d.open = true;
    const form = document.getElementById("colform");
    if (form) form.addEventListener("change", () => form.submit());
    window.scrollTo(0, y);
    version = v;
    body.dataset.version = String(v);
    body.dataset.updated = String(Date.now());
  }
  function notify() {
    if (document.getElementById("stale")) return;
    const note = document.createElement("p");
    note.id = "stale";
    note.className = "note stale";
    note.append("The run has new data since this page was made. ");
    const a = document.createElement("a");
    a.href = location.href;
    a.textContent = "reload";
    note.append(a);
    document.body.prepend(note);
  }
  async function poll() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const r = await fetch("/-/state.json", {cache: "no-store", credentials: "same-origin"});
      if (!r.ok) throw new Error("status " + r.status);
      const state = await r.json();
      const me = state.runs[run];
      if (me && me.version !== version) {
        if (body.dataset.swap === "1") await swap(me.version); else notify();
      }
      mark(true);
    } catch (e) {
      mark(false);
    } finally {
      busy = false;
    }
  }
  setInterval(poll, 1500);
})();
