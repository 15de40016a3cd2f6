// A hyperparameter sweep (#/sweeps/ID): its state, its trials best first, the objective metric of
// every trial over its steps, one scatter per searched parameter against the objective, and a link
// to the compare view with the best trials. Polled while the sweep runs; a trial's points are asked
// for from its last step on, and a trial that ended is not asked again.
"use strict";

(() => {
  const d = window.dptrain;
  const { api, every, el, badge, fmt } = d;
  const { makeChart, dropChart, appendPoints, alignSteps } = window.dptrainCharts;

  const COLORS = ["#2563eb", "#dc2626", "#15803d", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
  const SWEEP_TERMINAL = new Set(["succeeded", "cancelled", "failed"]);
  const TRIAL_TERMINAL = new Set(["succeeded", "failed", "cancelled", "pruned"]);
  const COMPARE_BEST = 4; // trials in the compare link: the best ones, a comparison still readable
  const DOT = "#2563eb";

  function scored(t) {
    return typeof t.objective === "number" && isFinite(t.objective);
  }

  // Best first by the objective's direction; trials without an objective after, by number.
  function ranked(sweep) {
    const sign = sweep.spec && sweep.spec.objective && sweep.spec.objective.direction === "maximize" ? -1 : 1;
    const withObjective = sweep.trials.filter(scored).sort((a, b) => sign * (a.objective - b.objective) || a.number - b.number);
    return [...withObjective, ...sweep.trials.filter((t) => !scored(t)).sort((a, b) => a.number - b.number)];
  }

  function paramPaths(sweep) {
    const fromSpace = Object.keys((sweep.spec && sweep.spec.space) || {});
    const seen = sweep.trials.flatMap((t) => Object.keys(t.params || {}));
    return [...new Set([...fromSpace, ...seen])].sort();
  }

  function showParam(v) {
    if (v === undefined) return "";
    return typeof v === "number" ? fmt(v) : typeof v === "string" ? v : JSON.stringify(v);
  }

  function colorOf(number) {
    return COLORS[number % COLORS.length];
  }

  // One scatter of a parameter against the objective: numbers on their own axis (a log one for a
  // log_uniform range), anything else (choices) at the index of its value, labelled with it.
  function scatter(container, path, domain, points, metric) {
    const numeric = points.every(([x]) => typeof x === "number");
    const labels = numeric ? [] : [...new Set(points.map(([x]) => JSON.stringify(x)))].sort();
    const xs = points.map(([x, y]) => [numeric ? x : labels.indexOf(JSON.stringify(x)), y]).sort((a, b) => a[0] - b[0]);
    const log = numeric && domain && "log_uniform" in domain && xs.every(([x]) => x > 0);
    const width = Math.max(280, container.clientWidth - 8);
    // eslint-disable-next-line no-undef
    const chart = new uPlot({
      width, height: 220, title: path,
      scales: { x: { time: false, distr: log ? 3 : 1, range: numeric ? undefined : () => [-0.5, labels.length - 0.5] } },
      axes: [
        numeric ? { label: path } : { label: path, splits: () => labels.map((_, i) => i), values: () => labels.map((l) => showParam(JSON.parse(l))) },
        { label: metric, size: 60 },
      ],
      series: [{ label: path }, { label: metric, stroke: DOT, fill: DOT, paths: () => null, points: { show: true, size: 8, fill: DOT } }],
      legend: { show: false },
    }, [xs.map(([x]) => x), xs.map(([, y]) => y)], container);
    d.currentScope().charts.push(chart);
    container.dataset.points = String(xs.length);
    return chart;
  }

  function sweepPage(view, sweepId) {
    const problem = el("p", { class: "error", role: "alert", id: "sweep-error" });
    const heading = el("h1", { class: "title", id: "sweep-title", text: `Sweep ${sweepId}` });
    const summary = el("dl", { class: "kv", id: "sweep-summary" });
    const compareLink = el("a", { id: "sweep-compare", hidden: true, text: "Compare the best trials" });
    const trialsHead = el("tr");
    const trialsBody = el("tbody", { id: "sweep-trials" });
    const objectiveBody = el("div", { class: "chart", "data-chart": "sweep-objective" });
    const scatterGrid = el("div", { class: "grid", id: "sweep-scatter" });
    // Trials are jobs labelled sweep=<id>: the job list's label filter shows them all, with their actions.
    const jobsLink = el("a", { id: "sweep-jobs", href: `#/?label=${encodeURIComponent(`sweep=${sweepId}`)}`, text: "Its trials in the job list" });
    view.append(el("section", { class: "card" }, heading, problem, summary, el("p", { class: "toolbar" }, compareLink, jobsLink)));
    const trialsCard = el("section", { class: "card", hidden: true },
      el("h2", { text: "Trials" }), el("table", { id: "sweep-trials-table" }, el("thead", {}, trialsHead), trialsBody));
    const objectiveCard = el("section", { class: "card", hidden: true }, el("h2", { id: "sweep-objective-title", text: "Objective" }), objectiveBody);
    const scatterCard = el("section", { class: "card", hidden: true }, el("h2", { text: "Parameters against the objective" }), scatterGrid);
    view.append(trialsCard, objectiveCard, scatterCard);

    let sweep = null;
    const series = new Map(); // job_id -> { data: name -> [steps[], values[]], lastStep, done }
    let objectiveChart = null; // { chart, key }
    let scatterKey = "";
    let scatterCharts = [];

    function metric() {
      return (sweep.spec && sweep.spec.objective && sweep.spec.objective.metric) || "loss";
    }

    function renderSummary() {
      heading.textContent = `Sweep ${sweep.name || sweep.id}`;
      const objective = sweep.spec && sweep.spec.objective;
      const ended = sweep.trials.filter((t) => TRIAL_TERMINAL.has(t.status)).length;
      const rows = [
        ["State", badge(sweep.state)],
        ["Id", el("span", { class: "mono", text: sweep.id })],
        ["Owner", sweep.owner || ""],
        ["Objective", objective ? `${objective.direction} ${objective.metric}` : ""],
        ["Sampler", (sweep.spec && sweep.spec.sampler) || ""],
        ["Pruner", (sweep.spec && sweep.spec.pruner && sweep.spec.pruner.type) || ""],
        ["Trials", `${ended} ended of ${sweep.trials.length} started` + (sweep.spec && sweep.spec.max_trials ? `, ${sweep.spec.max_trials} in all` : "")],
        ["Best", sweep.best ? `trial ${sweep.best.number}: ${fmt(sweep.best.objective)}` : "none yet"],
        ["Created", d.ago(sweep.created_at)],
      ];
      // Why a sweep failed when no trial of it did (a later trial's submit refused); text, never HTML.
      if (sweep.error) rows.push(["Error", el("span", { id: "sweep-failure", text: sweep.error })]);
      summary.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", {}, v)]));
      summary.querySelector("dd span.badge").id = "sweep-state";
    }

    function renderTrials() {
      const paths = paramPaths(sweep);
      trialsHead.replaceChildren(...["Trial", "Job", "Status", metric(), ...paths].map((h) => el("th", { text: h })));
      const bestNumber = sweep.best ? sweep.best.number : null;
      trialsBody.replaceChildren(...ranked(sweep).map((t) => {
        const isBest = t.number === bestNumber;
        const swatch = el("span", { class: "swatch" });
        swatch.style.background = colorOf(t.number);
        return el("tr", { "data-trial": t.number, "data-best": isBest ? "true" : null },
          el("td", {}, swatch, String(t.number), isBest ? el("span", { class: "badge best", text: "best" }) : null),
          el("td", {}, t.job_id ? el("a", { class: "mono", href: `#/jobs/${t.job_id}`, text: t.job_id.slice(0, 8) }) : ""),
          el("td", {}, badge(t.status)),
          el("td", { class: "mono", text: scored(t) ? fmt(t.objective) : "—" }),
          ...paths.map((p) => el("td", { class: "mono", text: showParam((t.params || {})[p]) })));
      }));
      trialsCard.hidden = !sweep.trials.length;
      const best = ranked(sweep).filter(scored).filter((t) => t.job_id).slice(0, COMPARE_BEST).map((t) => t.job_id);
      compareLink.hidden = best.length < 2;
      compareLink.href = `#/compare?ids=${best.map(encodeURIComponent).join(",")}`;
    }

    // The objective metric of each trial over its steps: one line per trial, in its table colour.
    function drawObjective() {
      const trials = sweep.trials.filter((t) => t.job_id && series.has(t.job_id)).sort((a, b) => a.number - b.number);
      const columns = trials.map((t) => series.get(t.job_id).data[metric()]);
      objectiveCard.hidden = !columns.some((c) => c && c[0].length);
      if (objectiveCard.hidden) return;
      const key = trials.map((t) => t.number).join(",");
      if (!objectiveChart || objectiveChart.key !== key) {
        // uPlot's series are fixed at construction: a new trial is a new chart.
        if (objectiveChart) dropChart(objectiveChart.chart);
        const lines = trials.map((t) => ({ label: `trial ${t.number}`, color: colorOf(t.number), points: metric().startsWith("eval/") }));
        objectiveChart = { key, chart: makeChart(objectiveBody, metric(), lines) };
      }
      objectiveBody.dataset.series = String(columns.filter((c) => c && c[0].length).length);
      objectiveChart.chart.setData(alignSteps(columns));
    }

    function drawScatter() {
      const space = (sweep.spec && sweep.spec.space) || {};
      const withObjective = sweep.trials.filter(scored);
      const paths = paramPaths(sweep);
      const key = JSON.stringify(withObjective.map((t) => [t.number, t.objective]));
      scatterCard.hidden = !withObjective.length || !paths.length;
      if (scatterCard.hidden || key === scatterKey) return;
      scatterKey = key;
      scatterCharts.forEach(dropChart);
      const boxes = paths.map((path) => ({
        path, points: withObjective.filter((t) => t.params && path in t.params).map((t) => [t.params[path], t.objective]),
        box: el("div", { class: "chart", "data-chart": "sweep-scatter", "data-param": path }),
      })).filter((b) => b.points.length);
      // Every box in the grid first: a chart takes the width its box has when it is drawn.
      scatterGrid.replaceChildren(...boxes.map((b) => b.box));
      scatterCharts = boxes.map((b) => scatter(b.box, b.path, space[b.path], b.points, metric()));
    }

    // New points of every trial not known to have ended; a trial is read once more after it ends.
    async function loadSeries() {
      await Promise.all(sweep.trials.filter((t) => t.job_id).map(async (t) => {
        const entry = series.get(t.job_id) || { data: {}, lastStep: -1, done: false };
        series.set(t.job_id, entry);
        if (entry.done) return;
        const since = entry.lastStep >= 0 ? `&since_step=${entry.lastStep - 1}` : "";
        try {
          const { data } = await api(`/v1/jobs/${encodeURIComponent(t.job_id)}/metrics?name=${encodeURIComponent(metric())}${since}&max_points=${d.MAX_CHART_POINTS}`);
          entry.lastStep = Math.max(entry.lastStep, appendPoints(entry.data, data.series));
          entry.done = TRIAL_TERMINAL.has(t.status);
        } catch (err) {
          if (err instanceof d.Unauthorized) throw err;
          d.showLive(`trial ${t.number}: ${err.message}`);
        }
      }));
    }

    function render() {
      renderSummary();
      renderTrials();
      drawObjective();
      drawScatter();
      d.showLive(SWEEP_TERMINAL.has(sweep.state) ? "" : "live: polling");
    }

    async function refresh() {
      if (SWEEP_TERMINAL.has(sweep.state) && [...series.values()].every((e) => e.done)) return;
      sweep = (await api(`/v1/sweeps/${encodeURIComponent(sweepId)}`)).data;
      sweep.trials ||= [];
      await loadSeries();
      render();
    }

    (async () => {
      try {
        sweep = (await api(`/v1/sweeps/${encodeURIComponent(sweepId)}`)).data;
      } catch (err) {
        if (!(err instanceof d.Unauthorized)) problem.textContent = `Could not load the sweep: ${err.message}`;
        return;
      }
      sweep.trials ||= [];
      await loadSeries().catch(() => null);
      render();
      every(d.DETAIL_POLL_MS, refresh);
    })();
  }

  window.dptrainViews.sweep = sweepPage;
})();
