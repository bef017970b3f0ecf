// fastapi-workqueue dashboard: keeps the page's live sections fresh without a reload, and asks
// before an action that drops work. No framework, no build step; the page works without it.
(function () {
  "use strict";

  var body = document.body;
  var interval = parseInt(body.getAttribute("data-poll-ms") || "5000", 10);
  var status = document.getElementById("live-status");
  var busy = false;

  function say(text) {
    if (status) { status.textContent = text; }
  }

  // A section is left alone while someone works in it: typing a note, or with a form focused.
  function inUse(section) {
    var active = document.activeElement;
    if (active && active !== body && section.contains(active)) { return true; }
    var fields = section.querySelectorAll("input[type=text]");
    for (var i = 0; i < fields.length; i++) { if (fields[i].value) { return true; } }
    if (section.querySelectorAll("input[type=checkbox]:checked").length > 0) { return true; }
    var open = section.querySelectorAll("details[open]");
    return open.length > 0;
  }

  function refresh() {
    if (busy || document.visibilityState === "hidden") { return; }
    var sections = document.querySelectorAll("[data-live][id]");
    if (!sections.length) { return; }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store",
                                  headers: { "X-Workqueue-Poll": "1" } })
      .then(function (response) {
        if (response.redirected && new URL(response.url).pathname.slice(-8) === "/sign-in") {
          window.location.reload();  // the session ended
          return null;
        }
        if (!response.ok) {
          say("Live updates paused: the server answered " + response.status + "; retrying.");
          return null;
        }
        return response.text();
      })
      .then(function (html) {
        if (html === null || html === undefined) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html");
        sections.forEach(function (section) {
          var replacement = fresh.getElementById(section.id);
          if (replacement && !inUse(section)) { section.innerHTML = replacement.innerHTML; }
        });
        say("Live: updated " + new Date().toLocaleTimeString());
      })
      .catch(function () { say("Live updates paused: the server cannot be reached; retrying."); })
      .then(function () { busy = false; });
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    var button = event.submitter;
    var question = (button && button.getAttribute && button.getAttribute("data-confirm")) ||
                   (form && form.getAttribute && form.getAttribute("data-confirm"));
    if (question && !window.confirm(question)) { event.preventDefault(); }
  });

  if (interval > 0 && document.querySelector("[data-live][id]")) {
    window.setInterval(refresh, interval);
    document.addEventListener("visibilitychange", function () {
      if (document.visibilityState === "visible") { refresh(); }
    });
    say("Live: every " + Math.round(interval / 1000) + " s");
  }
})();
