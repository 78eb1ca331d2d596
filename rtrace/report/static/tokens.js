/* rtrace: the token tooltip (rtrace/report/tokens.py), on rtrace serve's rollout page and the
 * page rtrace report --html writes.
 *
 * Each token of a coloured response carries its position, id, exact text and every per-token
 * array's value in data-tip (one per line). A native title tooltip takes about a second to
 * appear and then hides the next token's; this one shows at once, follows the pointer from token
 * to token, and stays inside the window. The text is set with textContent only.
 */
"use strict";
(function () {
  let tip = null;
  function hide() { if (tip) tip.hidden = true; }
  function show(tk) {
    if (!tip) {
      tip = document.createElement("div");
      tip.id = "tktip";
      tip.setAttribute("role", "tooltip");
      document.body.append(tip);
    }
    tip.textContent = tk.dataset.tip;
    tip.hidden = false;
    const r = tk.getBoundingClientRect();
    const x = Math.max(6, Math.min(r.left, window.innerWidth - tip.offsetWidth - 6));
    let y = r.bottom + 4;
    if (y + tip.offsetHeight > window.innerHeight - 6) y = Math.max(6, r.top - tip.offsetHeight - 4);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  document.addEventListener("mouseover", (e) => {
    const tk = e.target instanceof Element ? e.target.closest(".tk[data-tip]") : null;
    if (tk) show(tk); else hide();
  });
  window.addEventListener("scroll", hide, {passive: true});
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") hide(); });
})();
