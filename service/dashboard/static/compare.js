// Several jobs side by side (#/compare?ids=a,b, so a comparison can be shared and reloaded): their
// loss on one chart and a second chart of any other figure they report (evaluation first), one
// colour per job, and the settings their specs differ in. Running jobs are polled like the list:
// a conditional GET each (304 while nothing moved), then only their new points.
"use strict";

(() => {
  const d = window.dptrain;
  const { api, every, el, badge, progressBar, TERMINAL } = d;
  const { EVAL_PREFIX, evalOrder, makeChart, dropChart, appendPoints, alignSteps, spanning } = window.dptrainCharts;

  // One colour per job, far enough apart to tell on a white chart; it also caps how many jobs one
  // comparison takes, since more lines than that on one chart read as noise.
  const COLORS = ["#2563eb", "#dc2626", "#15803d", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
  const JOB_ID = /^[A-Za-z0-9_-]+$/;

  function shortId(id) {
    return id.slice(0, 8);
  }

  // The ids of a compare route, each once, in the order given; anything that is not an id is dropped
  // (it goes into API paths).
  function compareIds(params) {
    return [...new Set((params.get("ids") || "").split(",").map((x) => x.trim()).filter((x) => JOB_ID.test(x)))];
  }

  // A spec as dotted paths to leaf values: nested objects are walked, lists and empty objects are
  // values of their own (a changed list is one changed setting).
  function flatten(value, prefix = "", out = new Map()) {
    if (value !== null && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
      for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
    } else {
      out.set(prefix, value);
    }
    return out;
  }

  // The paths whose values are not the same in every spec (absent counts as a value), sorted, and the
  // number that are. `name` is left out: it heads each job's column instead.
  function specDiff(specs) {
    const flat = specs.map((s) => flatten(s));
    const paths = [...new Set(flat.flatMap((f) => [...f.keys()]))].filter((p) => p !== "name").sort();
    const changed = paths.filter((p) => new Set(flat.map((f) => (f.has(p) ? JSON.stringify(f.get(p)) : "absent"))).size > 1);
    return { flat, changed, same: paths.length - changed.length };
  }

  function showValue(flat, path) {
    if (!flat.has(path)) return el("td", { class: "muted", text: "—", title: "not set" });
    const v = flat.get(path);
    return el("td", { class: "mono", text: typeof v === "string" ? v : JSON.stringify(v) });
  }

  // A job as its chart legend shows it: its colour, name (linked to its page) and short id.
  function jobHeading(entry) {
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = entry.color;
    return el("span", { class: "job-key" }, swatch,
      el("a", { href: `#/jobs/${entry.id}`, text: entry.job.name }), " ", el("span", { class: "mono muted", text: shortId(entry.id) }));
  }

  function compare(view, params) {
    const ids = compareIds(params);
    const problem = el("p", { class: "error", role: "alert" });
    const jobsBody = el("tbody", { id: "compare-jobs" });
    const lossBody = el("div", { class: "chart", "data-chart": "compare-loss" });
    const metricSelect = el("select", { id: "compare-metric", "aria-label": "metric" });
    const metricBody = el("div", { class: "chart", "data-chart": "compare-metric" });
    const metricCard = el("section", { class: "card", hidden: true },
      el("div", { class: "toolbar" }, el("h2", { text: "Metric", class: "inline" }), metricSelect), metricBody);
    const diffHead = el("tr");
    const diffBody = el("tbody");
    const sameNote = el("p", { class: "muted", id: "compare-same" });
    view.append(el("section", { class: "card" }, el("h1", { class: "title", text: "Compare runs" }), problem,
      el("table", {}, el("thead", {}, el("tr", {}, ["Job", "Status", "Progress"].map((h) => el("th", { text: h })))), jobsBody)));
    if (ids.length < 2) {
      problem.textContent = "Pick two or more jobs in the job list to compare them.";
      return;
    }
    view.append(
      // One chart a row, not two side by side as on a job's page: a line per job wants the width, and
      // the metric card appearing later must not narrow a chart already drawn.
      el("section", { class: "card" }, lossBody), metricCard,
      el("section", { class: "card" }, el("h2", { text: "What changed" }),
        el("table", { id: "compare-diff" }, el("thead", {}, diffHead), diffBody), sameNote));
    if (ids.length > COLORS.length) problem.textContent = `Comparing the first ${COLORS.length} of ${ids.length} jobs.`;
    // entry: { id, color, job, etag, series: name -> [steps[], values[]], lastStep }
    let entries = ids.slice(0, COLORS.length).map((id, i) => ({ id, color: COLORS[i], job: null, etag: null, series: {}, lastStep: -1 }));
    let lossChart = null;
    let metricChart = null; // { chart, metric }
    let chosen = null; // the metric the user picked; until then the first one offered
    let lossSteps = [];

    function renderJobs() {
      jobsBody.replaceChildren(...entries.map((e) => el("tr", { "data-job-id": e.id },
        el("td", {}, jobHeading(e)), el("td", {}, badge(e.job.status)), el("td", {}, progressBar(e.job.progress)))));
    }

    function renderDiff() {
      const { flat, changed, same } = specDiff(entries.map((e) => e.job.spec));
      diffHead.replaceChildren(el("th", { text: "Setting" }), ...entries.map((e) => el("th", {}, jobHeading(e))));
      diffBody.replaceChildren(...changed.map((path) => el("tr", { "data-path": path },
        el("td", { class: "mono", text: path }), ...flat.map((f) => showValue(f, path)))));
      if (!changed.length) diffBody.append(el("tr", {}, el("td", { colspan: entries.length + 1, class: "muted", text: "No setting differs." })));
      sameNote.textContent = `${same} ${same === 1 ? "setting" : "settings"} identical in all ${entries.length} jobs (not shown).`;
    }

    // One series per job, null where a job has no value at a step; data-series says how many jobs
    // have points, for whoever needs to know what the canvas shows without reading pixels.
    function setSeries(chart, body, metric) {
      const columns = entries.map((e) => e.series[metric]);
      body.dataset.series = String(columns.filter((c) => c && c[0].length).length);
      const data = alignSteps(columns);
      chart.setData(data);
      return data[0];
    }

    function metricNames() {
      const names = new Set(entries.flatMap((e) => Object.keys(e.series)));
      names.delete("loss");
      const evals = [...names].filter((n) => n.startsWith(EVAL_PREFIX)).sort(evalOrder);
      return [...evals, ...[...names].filter((n) => !n.startsWith(EVAL_PREFIX)).sort()];
    }

    function lines(points) {
      return entries.map((e) => ({ label: `${e.job.name} (${shortId(e.id)})`, color: e.color, points }));
    }

    function draw() {
      lossChart ||= makeChart(lossBody, "Loss", lines(false));
      lossSteps = setSeries(lossChart, lossBody, "loss");
      const names = metricNames();
      if (names.join("\n") !== [...metricSelect.options].map((o) => o.value).join("\n")) {
        metricSelect.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
      }
      metricCard.hidden = !names.length;
      if (!names.length) return;
      const metric = names.includes(chosen) ? chosen : names[0];
      metricSelect.value = metric;
      if (metricChart === null || metricChart.metric !== metric) {
        // The title is the metric's, and uPlot keeps its title: a new chart for another metric.
        if (metricChart !== null) dropChart(metricChart.chart);
        // Evaluations are sparse: marked points, and the x range of the loss so they line up with it.
        const evaluation = metric.startsWith(EVAL_PREFIX);
        metricChart = { metric, chart: makeChart(metricBody, metric, lines(evaluation), evaluation ? spanning(() => lossSteps) : undefined) };
      }
      setSeries(metricChart.chart, metricBody, metric);
    }
    metricSelect.addEventListener("change", () => { chosen = metricSelect.value; draw(); });

    async function loadMetrics(e) {
      // The last step again: a step's evaluation may be stored a tick after its loss.
      const since = e.lastStep >= 0 ? `since_step=${e.lastStep - 1}&` : "";
      const { data } = await api(`/v1/jobs/${e.id}/metrics?${since}max_points=${d.MAX_CHART_POINTS}`);
      e.lastStep = Math.max(e.lastStep, appendPoints(e.series, data.series));
    }

    // A job that moved (its ETag changed) brings its new points; finished jobs are not asked again.
    async function refresh() {
      const moved = await Promise.all(entries.filter((e) => !TERMINAL.has(e.job.status)).map(async (e) => {
        const r = await api(`/v1/jobs/${e.id}`, { etag: e.etag });
        if (r.notModified) return false;
        e.job = r.data;
        e.etag = r.etag;
        await loadMetrics(e);
        return true;
      }));
      d.showLive(entries.some((e) => !TERMINAL.has(e.job.status)) ? "live: polling" : "");
      if (moved.some(Boolean)) { renderJobs(); draw(); }
    }

    (async () => {
      const found = await Promise.all(entries.map(async (e) => {
        try {
          const r = await api(`/v1/jobs/${e.id}`);
          e.job = r.data;
          e.etag = r.etag;
          await loadMetrics(e);
          return true;
        } catch (err) {
          if (err instanceof d.Unauthorized) throw err;
          problem.textContent = `${problem.textContent} job ${e.id}: ${err.message}.`.trim();
          return false;
        }
      })).catch(() => null);
      if (found === null) return; // signed out
      entries = entries.filter((e, i) => found[i]);
      if (!entries.length) return;
      renderJobs();
      renderDiff(); // a job's spec never changes
      draw();
      every(d.DETAIL_POLL_MS, refresh);
      d.showLive(entries.some((e) => !TERMINAL.has(e.job.status)) ? "live: polling" : "");
    })();
  }

  window.dptrainViews.compare = compare;
})();
