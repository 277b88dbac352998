// The review pages' keyboard and local times. The pages work without it: every key has a link or a button.
"use strict";
(function () {
  function localTimes() {
    var fmt = new Intl.DateTimeFormat(undefined, {dateStyle: "medium", timeStyle: "short"});
    document.querySelectorAll("time[datetime]").forEach(function (t) {
      var d = new Date(t.getAttribute("datetime"));
      if (!isNaN(d)) { t.title = t.textContent; t.textContent = fmt.format(d); }
    });
  }

  function press(selector) {
    var el = document.querySelector(selector);
    if (el) { el.click(); return true; }
    return false;
  }

  function go(id) {
    var a = document.getElementById(id);
    if (a && a.href) { window.location.href = a.href; return true; }
    return false;
  }

  // The queue: j / k move a selection over its rows; the row's link takes the focus (screen readers say it, and
  // Enter follows it); Enter also opens the selected row when the focus has left it (a click on the page).
  function rows() { return Array.prototype.slice.call(document.querySelectorAll("#queue tbody tr")); }

  function select(step) {
    var all = rows();
    if (!all.length) { return false; }
    var at = all.findIndex(function (r) { return r.classList.contains("selected"); });
    var to = at < 0 ? 0 : Math.min(Math.max(at + step, 0), all.length - 1);
    if (at >= 0) { all[at].classList.remove("selected"); all[at].removeAttribute("aria-current"); }
    all[to].classList.add("selected");
    all[to].setAttribute("aria-current", "true");
    all[to].querySelector("a.open").focus({preventScroll: true});
    all[to].scrollIntoView({block: "nearest"});
    return true;
  }

  function open() {
    var a = document.querySelector("#queue tr.selected a.open");
    if (a && document.activeElement === document.body) { window.location.href = a.href; return true; }
    return false;
  }

  var keys = {
    j: function () { return go("next") || select(1); },
    k: function () { return go("prev") || select(-1); },
    Enter: open,
    c: function () { return press("button[value=confirm]"); },
    r: function () { return press("button[value=reject]"); },
    u: function () { return press("button[value=unclear]"); },
    s: function () { return press("button[value=skip]"); },
    p: function () { return press("button[value=pass]"); },
    f: function () { return press("button[value=fail]"); },
    a: function () { return press("button[value=not_applicable]"); },
    n: function () {
      var note = document.getElementById("note");
      if (note) { note.focus(); return true; }
      return false;
    },
    "?": function () {
      var help = document.getElementById("help");
      if (help) { help.open = !help.open; if (help.open) { help.scrollIntoView({block: "nearest"}); } return true; }
      return false;
    }
  };

  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey) { return; }
    var t = e.target;
    if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT" || t.isContentEditable)) {
      if (e.key === "Escape") { t.blur(); }
      return;
    }
    var fn = keys[e.key];
    if (fn && fn()) { e.preventDefault(); }
  });

  // A followed quote: its message is highlighted (:target) and given the focus, for screen readers too.
  function focusTarget() {
    var id = window.location.hash.slice(1);
    var el = id && document.getElementById(id);
    if (el && el.classList.contains("msg")) { el.focus({preventScroll: true}); }
  }
  window.addEventListener("hashchange", focusTarget);
  document.addEventListener("DOMContentLoaded", function () { localTimes(); focusTarget(); });
})();
