// Chart helpers shared by a job's page and the compare view: one uPlot look, and the bookkeeping of
// series that arrive in pieces (polls, events) and have values at different steps.
"use strict";

(() => {
  const d = window.dptrain;

  const EVAL_PREFIX = "eval/";

  // `eval/loss` first, then the other evaluation figures by name.
  function evalOrder(a, b) {
    return (b === "eval/loss") - (a === "eval/loss") || a.localeCompare(b);
  }

  const compactFormat = new Intl.NumberFormat("en", { notation: "compact", maximumSignificantDigits: 3 });

  function compact(v) {
    return v === null || v === undefined ? "" : Math.abs(v) >= 1000 ? compactFormat.format(v) : String(+v.toPrecision(3));
  }

  // lines: [{ label, color, points }]; `points` marks each value (sparse series: evaluations), and a
  // line spans the steps where only other series have a value. xRange: uPlot's x scale range function.
  function makeChart(container, title, lines, xRange = undefined) {
    const width = Math.max(320, container.clientWidth - 8);
    // eslint-disable-next-line no-undef
    const chart = new uPlot({
      width, height: 220, title,
      scales: { x: { time: false, range: xRange } },
      // Compact tick labels (12k, 3.4M) so large throughputs are not clipped at the chart's edge.
      axes: [{ label: "step" }, { size: 60, values: (u, ticks) => ticks.map(compact) }],
      series: [{ label: "step" }, ...lines.map((l) => ({
        label: l.label, stroke: l.color, width: 2, spanGaps: true, points: { show: !!l.points, size: 6, fill: l.color },
      }))],
    }, [[], ...lines.map(() => [])], container);
    d.currentScope().charts.push(chart);
    return chart;
  }

  // Destroys a chart made by makeChart before its view ends (to build it again with other series).
  // A chart of a view already left is not in the current scope: that scope's charts stay.
  function dropChart(chart) {
    const all = d.currentScope().charts;
    const i = all.indexOf(chart);
    if (i >= 0) all.splice(i, 1);
    chart.destroy();
  }

  // Appends the [step, value] points of `incoming` (name -> points, as the API sends them) to
  // `series` (name -> [steps[], values[]]), skipping steps a series already has: a poll asks for the
  // last step again. Returns the highest step seen, or -1.
  function appendPoints(series, incoming) {
    let last = -1;
    for (const [name, points] of Object.entries(incoming)) {
      const data = (series[name] ||= [[], []]);
      for (const [step, value] of points) {
        if (data[0].length && step <= data[0][data[0].length - 1]) continue; // already have it
        data[0].push(step);
        data[1].push(value);
        last = Math.max(last, step);
      }
    }
    return last;
  }

  // uPlot takes one x array for all series: the union of their steps, null where one has no value
  // (drawn across by spanGaps). columns: [steps[], values[]] each, or undefined for a series with none.
  function alignSteps(columns) {
    const steps = [...new Set(columns.flatMap((c) => (c ? c[0] : [])))].sort((a, b) => a - b);
    return [steps, ...columns.map((c) => {
      if (!c) return steps.map(() => null);
      const at = new Map(c[0].map((step, i) => [step, c[1][i]]));
      return steps.map((step) => (at.has(step) ? at.get(step) : null));
    })];
  }

  // An x range that spans `steps` too: an evaluation chart beside the loss lines up with it.
  function spanning(stepsOf) {
    return (u, min, max) => {
      const steps = stepsOf();
      if (!steps.length) return [min, max];
      return [Math.min(min, steps[0]), Math.max(max, steps[steps.length - 1])];
    };
  }

  window.dptrainCharts = { EVAL_PREFIX, evalOrder, makeChart, dropChart, appendPoints, alignSteps, spanning };
})();
