// One job: header, cancel, continue and its ranks' stacks, live loss, evaluation, throughput and data-wait charts (uPlot), latest
// metrics, state timeline, checkpoints (the best one badged), artifacts, per-rank log tail and the spec. Live over the SSE stream;
// polling if that fails.
"use strict";

(() => {
  const d = window.dptrain;
  const { api, streamEvents, every, el, ago, jobDuration, bytes, fmt, badge, progressBar, TERMINAL } = d;
  const { EVAL_PREFIX, evalOrder, makeChart, dropChart, appendPoints, alignSteps, spanning } = window.dptrainCharts;

  const CHARTS = [
    { metric: "loss", title: "Loss", color: "#2563eb" },
    { metric: "samples_per_s", title: "Throughput (samples/s)", color: "#15803d" },
    // Of each step, the time the ranks waited for their batches: a slow input pipeline shows here.
    { metric: "data_wait_s", title: "Data wait (s per step)", color: "#b45309" },
  ];
  // Every `eval/<name>` series a job reports shares one chart, `eval/loss` first, one colour each.
  const EVAL_COLORS = ["#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  function jobDetail(view, jobId) {
    const s = d.currentScope();
    const header = el("section", { class: "card" });
    const error = el("section", { class: "card", hidden: true });
    const chartCards = CHARTS.map((c) => {
      const body = el("div", { class: "chart", "data-chart": c.metric });
      return { ...c, body, card: el("section", { class: "card" }, body) };
    });
    // Until the job reports an evaluation figure the card says why there is none.
    const evalNote = el("p", { class: "muted", id: "eval-note" });
    const evalEmpty = el("div", { class: "chart-empty" }, el("h2", { text: "Evaluation" }), evalNote);
    const evalBody = el("div", { class: "chart", "data-chart": "eval", hidden: true });
    const evalCard = el("section", { class: "card", id: "eval-card" }, evalEmpty, evalBody);
    const latest = el("dl", { class: "kv", id: "latest-metrics" });
    const timeline = el("tbody", { id: "timeline" });
    const ckpts = el("tbody", { id: "checkpoints" });
    const artifacts = el("tbody", { id: "artifacts" });
    const rankSelect = el("select", { id: "log-rank", "aria-label": "rank" }, el("option", { value: "", text: "all ranks" }));
    const logs = el("pre", { class: "logs", id: "logs" });
    const spec = el("pre", { class: "spec", id: "spec" });
    // Where every thread of every rank is, read on request by the job's workers (py-spy).
    const stacks = el("pre", { class: "logs", id: "stacks" });
    const stacksCard = el("section", { class: "card", hidden: true }, el("h2", { text: "Stacks" }), stacks);
    const problem = el("p", { class: "error", role: "alert" });
    view.append(header, problem, error, stacksCard,
      // The evaluation chart beside the loss chart.
      el("div", { class: "grid" }, chartCards[0].card, evalCard, chartCards.slice(1).map((c) => c.card)),
      el("div", { class: "grid" },
        el("section", { class: "card" }, el("h2", { text: "Latest metrics" }), latest),
        el("section", { class: "card" }, el("h2", { text: "Timeline" }),
          el("table", {}, el("thead", {}, el("tr", {}, ["When", "From", "To", "Attempt", "Reason"].map((h) => el("th", { text: h })))), timeline))),
      el("section", { class: "card" }, el("h2", { text: "Checkpoints" }),
        el("table", {}, el("thead", {}, el("tr", {}, ["Step", "Written", "Size", "sha256", ""].map((h) => el("th", { text: h })))), ckpts)),
      // What the job's script wrote to DPTRAIN_OUTPUT_DIR, as its last attempt's end found it.
      el("section", { class: "card" }, el("h2", { text: "Artifacts" }),
        el("table", {}, el("thead", {}, el("tr", {}, ["Path", "Size", "sha256", ""].map((h) => el("th", { text: h })))), artifacts)),
      el("section", { class: "card" }, el("div", { class: "toolbar" }, el("h2", { text: "Logs", style: "margin:0" }), rankSelect), logs),
      el("section", { class: "card" }, el("h2", { text: "Spec" }), spec));

    let job = null;
    let jobEtag = null;
    const charts = {};
    const series = {}; // metric -> [steps[], values[]]
    let lastStep = -1;
    let evalChart = null; // { chart, names }

    function renderHeader() {
      const cancel = el("button", { class: "danger", id: "cancel", text: job.cancel_requested ? "Cancelling…" : "Cancel",
        disabled: job.cancel_requested, hidden: TERMINAL.has(job.status), onclick: onCancel });
      // An ended job goes on from its newest checkpoint: its spec again, init_from it with resume.
      const cont = el("button", { id: "continue", text: "Continue", hidden: !TERMINAL.has(job.status), onclick: onContinue,
        title: "Submit this spec again, continuing from this job's newest checkpoint (optimizer and step included)" });
      const stacksButton = el("button", { id: "stacks-button", text: "Stacks", title: "Where every rank is now",
        hidden: job.status !== "running", onclick: onStacks });
      const init = job.init_checkpoint;
      header.replaceChildren(
        el("div", { class: "head" }, el("h1", { text: job.name }), badge(job.status), progressBar(job.progress),
          el("span", { class: "spacer" }), stacksButton, cancel, cont),
        el("dl", { class: "kv", style: "margin-top:10px" },
          el("dt", { text: "id" }), el("dd", { class: "mono", text: job.id }),
          el("dt", { text: "owner" }), el("dd", { text: job.owner }),
          el("dt", { text: job.spec.command ? "command" : "recipe" }),
          el("dd", { class: job.spec.command ? "mono" : null, text: job.spec.recipe || job.spec.entrypoint || (job.spec.command || []).join(" ") }),
          el("dt", { text: "ranks" }), el("dd", { text: `${job.spec.resources.nodes} × ${job.spec.resources.processes_per_node} ${job.spec.resources.device}` }),
          el("dt", { text: "attempt" }), el("dd", { text: String(job.attempt) }),
          init ? el("dt", { text: job.spec.init_from.resume ? "continues" : "starts from" }) : null,
          init ? el("dd", { id: "init-from" }, el("a", { href: `#/jobs/${init.job}`, class: "mono", text: init.job }),
            ` step ${init.step}`, el("span", { class: "muted mono", text: ` sha256 ${init.sha256.slice(0, 12)}…` })) : null,
          job.queue_position ? el("dt", { text: "queue position" }) : null,
          job.queue_position ? el("dd", { id: "queue-position", text: `#${job.queue_position} in the ${job.spec.resources.device} queue` }) : null,
          job.queued_reason ? el("dt", { text: "waiting" }) : null,
          job.queued_reason ? el("dd", { id: "queued-reason", text: job.queued_reason }) : null,
          el("dt", { text: "submitted" }), el("dd", { text: `${ago(job.created_at)} (${job.created_at})` }),
          el("dt", { text: "duration" }), el("dd", { text: jobDuration(job) || "not started" })));
      error.hidden = !job.error;
      if (job.error) {
        const e = job.error;
        error.replaceChildren(el("h2", { text: `Error: ${e.type}${e.rank !== null && e.rank !== undefined ? ` on rank ${e.rank}` : ""}` }),
          el("p", { class: "error", text: e.message }), e.traceback ? el("pre", { class: "spec", text: e.traceback }) : null);
      }
      evalNote.textContent = job.spec.evaluation
        ? `No evaluation yet: it runs every ${job.spec.evaluation.every_steps} steps and at the end.`
        : "No evaluation: this job's spec has no evaluation section.";
      latest.replaceChildren(...Object.entries(job.latest_metrics || {}).flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { class: "mono", text: fmt(v) })]));
      if (rankSelect.options.length === 1) {
        const world = job.spec.resources.nodes * job.spec.resources.processes_per_node;
        for (let r = 0; r < world; r++) rankSelect.append(el("option", { value: String(r), text: `rank ${r}` }));
      }
      spec.textContent = JSON.stringify(job.spec, null, 2);
    }

    async function onCancel(ev) {
      ev.target.disabled = true;
      try {
        const r = await api(`/v1/jobs/${jobId}/cancel`, { method: "POST" });
        setJob(r.data);
      } catch (e) { problem.textContent = e.message; ev.target.disabled = false; }
    }

    async function onContinue(ev) {
      ev.target.disabled = true;
      try {
        const r = await api("/v1/jobs", { method: "POST", body: { ...job.spec, init_from: { job: job.id, resume: true } } });
        location.hash = `#/jobs/${r.data.id}`;
      } catch (e) { problem.textContent = e.message; ev.target.disabled = false; }
    }

    async function onStacks(ev) {
      ev.target.disabled = true;
      stacksCard.hidden = false;
      stacks.textContent = "Asking the job's workers…";
      try {
        const r = await api(`/v1/jobs/${jobId}/stacks?wait=10`);
        stacks.textContent = stacksText(r.data);
      } catch (e) { stacks.textContent = e.message; }
      ev.target.disabled = false;
    }

    // As `dptrain stacks` prints it: each rank's frame, then each thread's frames, innermost first.
    function stacksText(found) {
      const lines = found.fresh ? [] : ["No fresh dump came in time: these are the latest ones."];
      if (!found.dumps.length) lines.push("No stacks have been read for this job yet.");
      for (const dump of found.dumps) {
        lines.push(`node ${dump.node}, attempt ${dump.attempt}, ${dump.reason} at ${dump.taken_at}`);
        if (dump.note) lines.push(`  note: ${dump.note}`);
        for (const p of dump.processes) {
          lines.push(`rank ${p.rank ?? "?"} pid ${p.pid}: ${p.where || p.error || "no frame"}`);
          for (const t of p.threads) {
            lines.push(`  thread ${t.thread_id} ${t.name || ""} (${t.active ? "active" : "idle"})`);
            for (const f of t.frames) lines.push(`    ${f.name} (${f.file}:${f.line})`);
          }
        }
      }
      return lines.join("\n");
    }

    function setJob(next) {
      const restarted = job && job.attempt !== next.attempt;
      const statusChanged = !job || job.status !== next.status || restarted;
      job = next;
      renderHeader();
      if (statusChanged) { loadTimeline(); loadArtifacts().catch(() => {}); }
      // A new attempt re-reads the checkpoint files, which may move the best mark without a new row.
      if (restarted) loadCheckpoints().catch(() => {});
    }

    function addPoints(newSeries) {
      lastStep = Math.max(lastStep, appendPoints(series, newSeries));
      for (const name of Object.keys(newSeries)) if (charts[name]) charts[name].setData(series[name]);
      // New loss points widen the evaluation chart's steps too (spanning the loss steps).
      if (Object.keys(newSeries).some((name) => name.startsWith(EVAL_PREFIX) || (name === "loss" && evalChart))) drawEval();
    }

    // The evaluation chart spans the loss chart's steps, so each evaluation lines up with the training
    // beside it.
    const lossSteps = spanning(() => (series.loss ? series.loss[0] : []));

    function drawEval() {
      const names = Object.keys(series).filter((n) => n.startsWith(EVAL_PREFIX)).sort(evalOrder);
      if (evalChart === null || evalChart.names.join("\n") !== names.join("\n")) {
        // A series uPlot was not built with: build the chart again (a job's eval names rarely change).
        if (evalChart !== null) dropChart(evalChart.chart);
        evalEmpty.hidden = true;
        evalBody.hidden = false;
        const lines = names.map((n, i) => ({ label: n, color: EVAL_COLORS[i % EVAL_COLORS.length], points: true }));
        evalChart = { names, chart: makeChart(evalBody, "Evaluation", lines, lossSteps) };
      }
      evalChart.chart.setData(alignSteps(names.map((n) => series[n])));
    }

    async function loadTimeline() {
      const { data } = await api(`/v1/jobs/${jobId}/timeline`);
      timeline.replaceChildren(...data.items.map((t) => el("tr", {},
        el("td", { text: ago(t.at), title: t.at }), el("td", { text: t.from_status || "" }), el("td", {}, badge(t.to_status)),
        el("td", { text: String(t.attempt) }), el("td", { text: t.reason || "" }))));
    }

    async function loadCheckpoints() {
      const { data } = await api(`/v1/jobs/${jobId}/checkpoints`);
      ckpts.replaceChildren(...data.items.map((c) => el("tr", { "data-step": c.step, "data-best": c.best },
        el("td", {}, String(c.step), c.best
          ? el("span", { class: "badge best", text: "best", title: `best ${bestMetric()} so far` }) : null),
        el("td", { text: ago(c.created_at), title: c.created_at }),
        el("td", { text: bytes(c.size_bytes) }), el("td", { class: "mono", text: c.sha256 }),
        el("td", {}, el("button", { text: "Download", onclick: () => download(`/v1/jobs/${jobId}/checkpoints/${c.id}/download`, `${jobId}-step${c.step}.pt`) })))));
    }

    async function loadArtifacts() {
      const { data } = await api(`/v1/jobs/${jobId}/artifacts`);
      artifacts.replaceChildren(...data.items.map((a) => el("tr", { "data-path": a.path },
        el("td", { class: "mono", text: a.path }), el("td", { text: bytes(a.size_bytes) }),
        el("td", { class: "mono", text: a.sha256 }),
        el("td", {}, el("button", { text: "Download", onclick: () => download(artifactUrl(a.path), a.path.split("/").pop()) })))));
    }

    function artifactUrl(path) {
      return `/v1/jobs/${jobId}/artifacts/${path.split("/").map(encodeURIComponent).join("/")}`;
    }

    function bestMetric() {
      const best = job && job.spec.checkpoint && job.spec.checkpoint.keep_best;
      return best ? best.metric : "evaluation";
    }

    async function download(url, filename) {
      // The download needs the bearer header, which a plain link cannot send: fetch it as a blob.
      const r = await fetch(url, {
        headers: { Authorization: `Bearer ${sessionStorage.getItem("dptrain.token")}` },
      });
      if (!r.ok) { problem.textContent = `download failed: ${r.status}`; return; }
      const blob = URL.createObjectURL(await r.blob());
      const a = el("a", { href: blob, download: filename });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(blob), 10000);
    }

    let logCursor = null;
    async function pollLogs() {
      const rank = rankSelect.value;
      const q = new URLSearchParams();
      if (rank) q.set("rank", rank);
      if (logCursor === null) q.set("tail", String(d.LOG_TAIL)); else q.set("after", String(logCursor));
      const { data } = await api(`/v1/jobs/${jobId}/logs?${q}`);
      if (!data.items.length) return;
      const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
      const text = data.items.map((l) => `${l.rank === null ? "launcher" : `rank${l.rank}`}| ${l.line}`).join("\n");
      logs.textContent = (logs.textContent ? `${logs.textContent}\n` : "") + text;
      const lines = logs.textContent.split("\n");
      if (lines.length > 2000) logs.textContent = lines.slice(-2000).join("\n");
      logCursor = data.next_cursor;
      if (atBottom) logs.scrollTop = logs.scrollHeight;
    }
    rankSelect.addEventListener("change", () => { logCursor = null; logs.textContent = ""; pollLogs(); });

    // The last step again: a step's evaluation may be stored a tick after its loss, and addPoints
    // skips the points each series already has.
    function sinceStep() {
      return Math.max(-1, lastStep - 1);
    }

    // Polling fallback: conditional GETs of the job, then only what is new.
    async function poll() {
      const r = await api(`/v1/jobs/${jobId}`, { etag: jobEtag });
      if (r.notModified) return;
      jobEtag = r.etag;
      setJob(r.data);
      const m = await api(`/v1/jobs/${jobId}/metrics?since_step=${sinceStep()}&max_points=${d.MAX_CHART_POINTS}`);
      addPoints(m.data.series);
      await loadCheckpoints();
    }

    async function listen() {
      const abort = new AbortController();
      s.aborts.push(abort);
      let gotEvent = false;
      try {
        await streamEvents(`/v1/jobs/${jobId}/events?since_step=${sinceStep()}&max_points=${d.MAX_CHART_POINTS}`, (type, data) => {
          gotEvent = true;
          d.showLive("live");
          if (type === "job") setJob(data);
          else if (type === "metrics") addPoints(data.series);
          else if (type === "checkpoint") loadCheckpoints();
          else if (type === "end") d.showLive("");
        }, abort.signal);
        if (job && TERMINAL.has(job.status)) return;
      } catch (e) {
        if (s.dead || e instanceof d.Unauthorized) return;
      }
      if (s.dead) return;
      // The stream is unavailable (or dropped before the end): fall back to polling.
      d.showLive(gotEvent ? "reconnecting: polling" : "polling");
      every(d.DETAIL_POLL_MS, poll);
    }

    (async () => {
      try {
        const r = await api(`/v1/jobs/${jobId}`);
        jobEtag = r.etag;
        setJob(r.data);
      } catch (e) {
        if (!(e instanceof d.Unauthorized)) problem.textContent = e.message;
        return;
      }
      for (const c of chartCards) charts[c.metric] = makeChart(c.body, c.title, [{ label: c.title, color: c.color }]);
      const m = await api(`/v1/jobs/${jobId}/metrics?max_points=${d.MAX_CHART_POINTS}`);
      addPoints(m.data.series);
      await loadCheckpoints();
      every(d.DETAIL_POLL_MS, pollLogs)();
      listen();
    })();
  }

  window.dptrainViews.jobDetail = jobDetail;
})();
