// idem dashboard: the live refresh. Every few seconds while the tab is
// visible, the page is fetched again and its <main> replaced; the figures
// ([data-figure]) and job rows ([data-job]) that changed are marked for a
// few seconds. Hidden tab: paused. Without script: a plain page.
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  if (!main || !window.fetch || !window.DOMParser) { return; }
  var every = Math.max(2, parseInt(main.getAttribute("data-live"), 10) || 5) * 1000;
  var badge = document.getElementById("live");
  var timer = null, busy = false;

  function status(text, cls) {
    if (!badge) { return; }
    badge.hidden = false;
    badge.textContent = text;
    badge.className = "live " + (cls || "");
  }

  // key names an element across refreshes: its id, or its closest id'd
  // ancestor's and its data-figure or data-job.
  function keyOf(el) {
    var f = el.getAttribute("data-figure"), j = el.getAttribute("data-job");
    var owner = el.parentElement && el.parentElement.closest("[id]");
    return (owner ? owner.id : "") + "|" + (f ? "f:" + f : "j:" + j);
  }
  function snapshot(root) {
    var m = {};
    root.querySelectorAll("[data-figure],[data-job]").forEach(function (el) {
      m[keyOf(el)] = el.getAttribute("data-job") !== null ? el.getAttribute("data-state") : el.textContent.trim();
    });
    return m;
  }

  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(location.href, { cache: "no-store", credentials: "same-origin" })
      .then(function (r) {
        if (!r.ok) { throw new Error(r.status === 503 ? "busy" : "HTTP " + r.status); }
        return r.text();
      })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var next = doc.querySelector("main[data-live]");
        if (!next) { throw new Error("no page"); }
        var before = snapshot(main);
        main.innerHTML = next.innerHTML;
        var changed = 0;
        main.querySelectorAll("[data-figure],[data-job]").forEach(function (el) {
          var k = keyOf(el);
          var now = el.getAttribute("data-job") !== null ? el.getAttribute("data-state") : el.textContent.trim();
          if (!(k in before) ? el.getAttribute("data-job") !== null : before[k] !== now) {
            el.classList.add("changed");
            changed++;
          }
        });
        var clock = doc.querySelector('[data-figure="clock"]'), mine = document.querySelector('header [data-figure="clock"]');
        if (clock && mine) { mine.textContent = clock.textContent; }
        main.setAttribute("data-updates", String((parseInt(main.getAttribute("data-updates"), 10) || 0) + 1));
        status(changed ? "live · " + changed + " changed" : "live", "ok");
      })
      .catch(function (e) { status("live · " + e.message + ", retrying", "warn"); })
      .then(function () { busy = false; });
  }

  function start() {
    if (timer === null) { timer = setInterval(refresh, every); }
    status("live", "ok");
  }
  function stop() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    status("paused", "");
  }
  document.addEventListener("visibilitychange", function () {
    if (document.hidden) { stop(); } else { refresh(); start(); }
  });
  if (document.hidden) { stop(); } else { start(); }
})();
