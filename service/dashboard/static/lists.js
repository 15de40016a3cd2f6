// The job list and the workers page: tables refreshed by cheap conditional polls (ETag -> 304).
"use strict";

(() => {
  const { api, every, el, ago, duration, jobDuration, badge, progressBar, STATUSES, LIST_POLL_MS, WORKERS_POLL_MS } =
    window.dptrain;

  // The jobs picked for comparing: kept while the page lives, so that paging and filtering the list
  // does not lose them (a comparison may take jobs from different pages).
  const selected = new Set();

  function labelChips(labels) {
    return Object.entries(labels || {}).map(([k, v]) => el("span", { class: "chip", text: `${k}=${v}` }));
  }

  function jobList(view, params) {
    const status = params.get("status") || "";
    const labels = params.getAll("label");
    // Keyset pages: a stack of the cursors that led to each page, so "Newer" can go back.
    const cursors = (params.get("pages") || "").split(",").filter(Boolean);
    const cursor = cursors.length ? cursors[cursors.length - 1] : null;

    const statusSelect = el("select", { id: "filter-status", "aria-label": "status" },
      el("option", { value: "", text: "all statuses" }),
      STATUSES.map((s) => el("option", { value: s, text: s, selected: s === status })));
    const labelInput = el("input", { id: "filter-label", placeholder: "label key=value, …", value: labels.join(", ") });
    const apply = () => {
      const q = new URLSearchParams();
      if (statusSelect.value) q.set("status", statusSelect.value);
      for (const l of labelInput.value.split(",").map((x) => x.trim()).filter(Boolean)) q.append("label", l);
      location.hash = `#/?${q}`;
    };
    statusSelect.addEventListener("change", apply);
    labelInput.addEventListener("keydown", (ev) => { if (ev.key === "Enter") apply(); });

    const tbody = el("tbody", { id: "jobs-body" });
    const empty = el("p", { class: "muted", text: "No jobs match.", hidden: true });
    const error = el("p", { class: "error", role: "alert" });
    const older = el("button", { id: "older", text: "Older →", disabled: true });
    const newer = el("button", { id: "newer", text: "← Newer", disabled: !cursors.length });
    const compare = el("button", { id: "compare", class: "primary", text: "Compare", disabled: true, title: "pick two or more jobs to compare",
      onclick: () => { location.hash = `#/compare?ids=${[...selected].join(",")}`; } });
    const clear = el("button", { id: "compare-clear", class: "link", text: "clear", hidden: true,
      onclick: () => { selected.clear(); render(); } });
    view.append(el("section", { class: "card" },
      el("div", { class: "toolbar" }, el("h2", { text: "Jobs", style: "margin:0" }), statusSelect, labelInput,
        el("button", { text: "Filter", onclick: apply }), el("span", { class: "spacer" }), clear, compare),
      el("table", { id: "jobs" },
        el("thead", {}, el("tr", {}, [el("th", { class: "select", "aria-label": "select" }), ...["Status", "Progress", "Name", "Owner", "Labels", "Age", "Duration"].map((h) => el("th", { text: h }))])),
        tbody),
      empty, error,
      el("div", { class: "pager" }, newer, older)));

    let etag = null;
    let jobs = [];
    let next = null;
    const go = (stack) => {
      const q = new URLSearchParams(params);
      if (stack.length) q.set("pages", stack.join(",")); else q.delete("pages");
      location.hash = `#/?${q}`;
    };
    newer.addEventListener("click", () => go(cursors.slice(0, -1)));
    older.addEventListener("click", () => next && go([...cursors, next]));

    // One checkbox per job, reused by every render of this list: it redraws each poll, and a click
    // that lands while it does still reaches the same box.
    const boxes = new Map();
    function checkbox(id) {
      if (!boxes.has(id)) {
        boxes.set(id, el("input", { type: "checkbox", class: "pick", "aria-label": "compare",
          onchange: (ev) => { if (ev.target.checked) selected.add(id); else selected.delete(id); render(); } }));
      }
      const box = boxes.get(id);
      box.checked = selected.has(id);
      return box;
    }

    function render() {
      tbody.replaceChildren(...jobs.map((j) => el("tr", {
        class: "clickable", "data-job-id": j.id,
        onclick: () => { location.hash = `#/jobs/${j.id}`; },
      },
      // Ticking a box picks the job; it does not open it.
      el("td", { class: "select", onclick: (ev) => ev.stopPropagation() }, checkbox(j.id)),
      el("td", {}, badge(j.status), j.queue_position ? el("span", { class: "muted", title: "queue position", text: ` #${j.queue_position}` }) : null),
      el("td", {}, progressBar(j.progress)),
      el("td", {}, el("a", { href: `#/jobs/${j.id}`, text: j.name })),
      el("td", { text: j.owner }),
      el("td", {}, labelChips(j.labels ?? j.spec.labels)),
      el("td", { text: ago(j.created_at), title: j.created_at }),
      el("td", { text: jobDuration(j) }))));
      empty.hidden = jobs.length > 0;
      compare.textContent = selected.size ? `Compare (${selected.size})` : "Compare";
      compare.disabled = selected.size < 2;
      clear.hidden = !selected.size;
      older.disabled = !next;
    }

    const q = new URLSearchParams({ limit: "25" });
    if (status) q.set("status", status);
    for (const l of labels) q.append("label", l);
    if (cursor) q.set("cursor", cursor);
    const refresh = every(LIST_POLL_MS, async () => {
      try {
        const r = await api(`/v1/jobs?${q}`, { etag });
        error.textContent = "";
        if (!r.notModified) { jobs = r.data.items; next = r.data.next_cursor; etag = r.etag; }
      } catch (e) {
        if (e instanceof window.dptrain.Unauthorized) throw e;
        error.textContent = e.message;
      }
      render(); // ages and durations move on even when the data did not
    });
    refresh();
  }

  function workers(view) {
    const tbody = el("tbody", { id: "workers-body" });
    const note = el("p", { class: "muted" });
    view.append(el("section", { class: "card" }, el("h2", { text: "Workers" }),
      el("table", { id: "workers" },
        el("thead", {}, el("tr", {}, ["Node", "Address", "Devices", "Slots (free)", "Running jobs", "Last heartbeat", "Status"].map((h) => el("th", { text: h })))),
        tbody),
      note));
    const refresh = every(WORKERS_POLL_MS, async () => {
      const { data } = await api("/v1/workers");
      tbody.replaceChildren(...data.items.map((w) => el("tr", { "data-worker": w.name },
        el("td", { text: w.name }),
        // Admins only: the API gives a user neither address nor host name.
        el("td", { class: "mono", text: w.address ?? "—", title: w.hostname }),
        el("td", { text: `${w.device_count} × ${w.device}` }),
        el("td", { text: `${w.slots} (${w.free_slots})` }),
        el("td", {}, (w.running_jobs || []).map((id) => el("a", { href: `#/jobs/${id}`, class: "mono", text: `${id} ` }))),
        el("td", { text: `${duration(w.heartbeat_age_seconds)} ago`, title: w.last_heartbeat }),
        el("td", {}, badge(w.status)))));
      note.textContent = data.items.length ? "" : "No worker has reported yet: start one with `dptrain worker`.";
    });
    refresh();
  }

  window.dptrainViews.jobList = jobList;
  window.dptrainViews.workers = workers;
})();
