// The live dashboard page: poll the pool's JSON and redraw four plotly charts, one more when
// the cell runs a pipeline, one more when its model offloads and one more when an inference
// engine generates. Memory per tier and the step-time split are per rank (latest values);
// tokens/s per rank and bytes per mesh axis (collectives, and point-to-point bytes sent,
// dotted) are time series of the running (or last) %%colossal cell. The pipeline stage
// timeline, the offload panel (model state per tier, bytes moved between tiers per step) and
// the inference panel (generated tokens/s, the queue, KV blocks per replica) come as ready
// traces (workbench/ui/dashboard/timeline.py, offload.py and inference.py build them for the
// notebook's figures too), so this page only lays them out. While `%colossal serve` serves, the
// pool's endpoint (its line, and its panel: requests/s, in flight, KV use; endpoint.py) stands
// on top and the serving ranks' telemetry is the running cell. A cell that trains has the curves
// panel on top (loss and eval loss on a log axis, LR, grad norm; curves.py), its smoothed
// traces smoothed again here from their raw ones as the slider moves (TensorBoard's EMA);
// once it ends after an earlier cell that trained, a button under it draws the two runs
// compared (workbench.compare's figure, from the file).
// A cell whose expert-parallel MoE model steps has the expert-load heatmap under the four
// charts (tokens per expert per layer of the last step, all ranks; expert_load.py).
(function () {
  'use strict';
  const cfg = window.COLOSSAL;
  const url = cfg.baseUrl + 'workbench/pools/' + encodeURIComponent(cfg.poolId);
  const status = document.getElementById('status');
  const plotConfig = { displaylogo: false, responsive: true };
  document.getElementById('pool-id').textContent = cfg.poolId;

  // One look with the notebook's figures (workbench/ui/dashboard/style.py, whose tables these
  // are; tests/workbench/ui/test_dashboard_theme.py checks they agree): a colour per rank, a
  // colour per named series, units on axes and hovers.
  const RANK_COLOURS = ['#54a24b', '#e45756', '#72b7b2', '#eeca3b', '#ff9da6', '#9d755d',
    '#4c78a8', '#f58518', '#b279a2', '#bab0ac'];
  const NAMED = {
    device: '#4c78a8', host: '#f58518', disk: '#b279a2',
    compute: '#4c78a8', comm: '#f58518', waiting: '#bab0ac'
  };
  const BYTES_AXIS = { tickformat: '~s', ticksuffix: 'B' };

  function nameHash(name) {
    let h = 0;
    for (let i = 0; i < name.length; i++) { h = (h * 31 + name.charCodeAt(i)) % 4294967296; }
    return h;
  }

  function colour(key) {
    if (typeof key === 'number') { return RANK_COLOURS[key % RANK_COLOURS.length]; }
    const m = /^(rank|run) (\d+)$/.exec(key);
    if (m) {
      const n = Number(m[2]) - (m[1] === 'run' ? 1 : 0);
      return RANK_COLOURS[Math.max(n, 0) % RANK_COLOURS.length];
    }
    return NAMED[key] || RANK_COLOURS[nameHash(key) % RANK_COLOURS.length];
  }

  function size(n) {
    const units = [['GiB', 1073741824], ['MiB', 1048576], ['KiB', 1024]];
    for (const [unit, scale] of units) {
      if (Math.abs(n) >= scale) { return (n / scale).toFixed(1) + ' ' + unit; }
    }
    return String(Math.round(n || 0)) + ' B';
  }

  // The theme: the lab's, from the link the sidebar opened (?theme=dark) and then from the
  // lab's theme setting (polled, so a switch in the lab restyles this page too). The page's
  // CSS variables hold the colours; every layout takes them through themed().
  let theme = new URLSearchParams(window.location.search).get('theme') === 'dark'
    ? 'dark' : 'light';
  const themeUrl = cfg.baseUrl + 'lab/api/settings/@jupyterlab/apputils-extension:themes';

  function applyTheme(next) {
    theme = next;
    document.documentElement.dataset.theme = theme;
  }
  applyTheme(theme);

  async function followLabTheme() {
    try {
      const response = await fetch(themeUrl, { credentials: 'same-origin' });
      if (response.ok) {
        const chosen = ((await response.json()).settings || {}).theme;
        const next = typeof chosen === 'string' && /dark/i.test(chosen) ? 'dark'
          : (typeof chosen === 'string' ? 'light' : theme);
        if (next !== theme) {
          applyTheme(next);
          if (lastDoc) { render(lastDoc); }
        }
      }
    } catch (err) {
      // the lab's settings are out of reach: keep the link's theme
    }
    setTimeout(followLabTheme, 1000);
  }

  function themed(lay) {
    const css = getComputedStyle(document.documentElement);
    const fg = css.getPropertyValue('--fg').trim();
    const grid = css.getPropertyValue('--grid').trim();
    const axis = { gridcolor: grid, zerolinecolor: grid, linecolor: grid };
    const out = Object.assign({}, lay, {
      paper_bgcolor: 'rgba(0,0,0,0)', plot_bgcolor: 'rgba(0,0,0,0)',
      font: Object.assign({}, lay.font, { color: fg }), colorway: RANK_COLOURS,
      meta: { workbench: 'themed', theme: theme }
    });
    out.xaxis = out.xaxis || {};
    out.yaxis = out.yaxis || {};
    Object.keys(out).filter(k => /^[xy]axis\d*$/.test(k))
      .forEach(k => { out[k] = Object.assign({}, out[k], axis); });
    return out;
  }

  function react(id, traces, lay) {
    Plotly.react(id, traces, themed(lay), plotConfig);
  }

  function layout(title, ytitle, extra) {
    return Object.assign({
      title: { text: title, font: { size: 14 } },
      margin: { l: 60, r: 20, t: 40, b: 40 },
      yaxis: { title: { text: ytitle } },
      legend: { orientation: 'h' }
    }, extra || {});
  }

  function stateLabel(doc) {
    if (doc.state === 'running') { return doc.endpoint ? 'serving' : 'idle'; }
    return doc.state;
  }

  let lastDoc = null;

  function render(doc) {
    lastDoc = doc;
    const cell = doc.cell;
    const series = cell ? cell.series
      : { t: [], tokens_per_s: {}, comm_bytes: {}, p2p_bytes: {} };
    const ranks = doc.ranks.length ? doc.ranks.map(r => r.rank)
      : (cell ? cell.ranks : []);
    const names = ranks.map(r => 'rank ' + r);
    const latest = cell ? cell.latest : {};
    const memOf = r => {
      const live = latest[String(r)];
      const row = doc.ranks.find(x => x.rank === r);
      return (live && live.memory) || (row && row.memory) || { device: 0, host: 0, disk: 0 };
    };
    const tiers = ['device', 'host', 'disk'].map(tier => {
      const y = ranks.map(r => memOf(r)[tier]);
      return {
        type: 'bar', name: tier, x: names, y: y, customdata: y.map(size),
        marker: { color: colour(tier) },
        hovertemplate: '%{x}: %{y:,} B (%{customdata}) on ' + tier + '<extra></extra>'
      };
    });
    react('memory', tiers, layout('memory per tier', 'bytes',
      { barmode: 'group', yaxis: Object.assign({ title: { text: 'bytes' } }, BYTES_AXIS) }));
    const parts = ['compute', 'comm', 'waiting'].map(part => ({
      type: 'bar', name: part, x: names, marker: { color: colour(part) },
      y: ranks.map(r => ((latest[String(r)] || {}).seconds || {})[part] || 0),
      hovertemplate: '%{x}: %{y:.3f} s ' + part + '<extra></extra>'
    }));
    react('split', parts, layout('step time split (cumulative)', 'seconds',
      { barmode: 'stack', yaxis: { title: { text: 'seconds' }, ticksuffix: ' s' } }));
    const tokens = Object.keys(series.tokens_per_s).map(r => ({
      type: 'scatter', mode: 'lines+markers', name: 'rank ' + r, x: series.t,
      y: series.tokens_per_s[r], line: { color: colour(Number(r)) },
      marker: { color: colour(Number(r)) },
      hovertemplate: 'rank ' + r + ': %{y:,.1f} tokens/s at %{x:.1f} s<extra></extra>'
    }));
    react('tokens', tokens, layout('tokens/s per rank', 'tokens/s',
      { xaxis: { title: { text: 'seconds into the cell' }, ticksuffix: ' s' } }));
    const comm = Object.keys(series.comm_bytes).map(axis => ({
      type: 'scatter', mode: 'lines', name: axis, x: series.t, y: series.comm_bytes[axis],
      line: { color: colour('comm: ' + axis) }, customdata: series.comm_bytes[axis].map(size),
      hovertemplate: axis + ': %{y:,} B (%{customdata}) at %{x:.1f} s<extra></extra>'
    }));
    const p2p = series.p2p_bytes || {};
    Object.keys(p2p).forEach(axis => comm.push({
      type: 'scatter', mode: 'lines', name: axis + ' p2p (sent)', x: series.t, y: p2p[axis],
      line: { dash: 'dot', color: colour('comm: ' + axis) }, customdata: p2p[axis].map(size),
      hovertemplate: axis + ' p2p sent: %{y:,} B (%{customdata}) at %{x:.1f} s<extra></extra>'
    }));
    react('comm', comm, layout('bytes communicated per axis', 'bytes',
      { xaxis: { title: { text: 'seconds into the cell' }, ticksuffix: ' s' },
        yaxis: Object.assign({ title: { text: 'bytes' } }, BYTES_AXIS) }));
    lastCurves = cell ? cell.curves : null;
    renderCurves();
    renderCompare(cell ? cell.compare : null);
    renderStages(cell ? cell.stages : null);
    renderPanel('offload', cell ? cell.offload : null);
    renderPanel('inference', cell ? cell.inference : null);
    renderPanel('expert-load', cell ? cell.expert_load : null);
    renderEndpoint(doc.endpoint);

    let text = doc.world_size + ' ranks, ' + stateLabel(doc);
    if (doc.error) { text += ' (' + doc.error + ')'; }
    if (cell) {
      text += ' | ' + (doc.endpoint ? 'endpoint ' : 'cell ') +
        (cell.running ? 'running' : 'finished') + ': ' + cell.label +
        ' (' + cell.elapsed.toFixed(1) + ' s, ' + series.t.length + ' points)';
    }
    status.textContent = text;
    status.dataset.state = doc.state;
    status.dataset.points = String(series.t.length);
    status.dataset.cellRunning = cell && cell.running ? 'true' : 'false';
  }

  // TensorBoard's smoothing: an exponential moving average, debiased (curves.py's smooth).
  function smooth(values, weight) {
    let last = 0, n = 0;
    return values.map(v => {
      if (!Number.isFinite(v)) { return v; }
      last = last * weight + (1 - weight) * v; n += 1;
      return last / (1 - Math.pow(weight, n));
    });
  }

  let lastCurves = null;
  const slider = document.getElementById('smoothing');
  slider.addEventListener('input', () => {
    document.getElementById('smoothing-value').textContent = Number(slider.value).toFixed(2);
    renderCurves();
  });

  // The curves panel with the slider's smoothing; hidden (with the slider) when no step trained.
  function renderCurves() {
    const panel = lastCurves;
    document.getElementById('smoothing-box').hidden = !panel;
    if (!panel) { renderPanel('curves', null); return; }
    const weight = Number(slider.value);
    const raw = {};
    panel.traces.forEach(t => { raw[t.name] = t; });
    const traces = panel.traces.map(t => (t.meta && t.meta.smooth_of && raw[t.meta.smooth_of])
      ? Object.assign({}, t, { y: smooth(raw[t.meta.smooth_of].y, weight) }) : t);
    const title = panel.title.replace(/smoothing [0-9.]+/, 'smoothing ' + weight.toFixed(2));
    renderPanel('curves', Object.assign({}, panel, {
      traces: traces, title: title,
      layout: Object.assign({}, panel.layout, { title: { text: title, font: { size: 14 } } })
    }));
  }

  // "Compare with the previous run": once a cell that trained ends after another that did,
  // the file holds compare(previous, this) as ready traces (workbench/ui/dashboard/previous.py,
  // the notebook's workbench.compare figure); the button shows or hides it.
  let showCompare = false;
  const compareButton = document.getElementById('compare-button');
  compareButton.addEventListener('click', () => {
    showCompare = !showCompare;
    if (lastDoc) { render(lastDoc); }
  });

  function renderCompare(panel) {
    document.getElementById('compare-box').hidden = !panel;
    if (!panel) { showCompare = false; }
    compareButton.textContent = showCompare ? 'hide the comparison'
      : 'compare with the previous run';
    renderPanel('compare', showCompare ? panel : null, 70);  // title above subplot titles
  }

  // The pipeline stage timeline: one row per pipeline rank; hidden when no pipeline ran.
  function renderStages(stages) {
    const el = document.getElementById('stages');
    el.hidden = !stages;
    if (!stages) { return; }
    react('stages', stages.traces, layout(stages.title, '', {
      barmode: 'overlay', xaxis: stages.xaxis, yaxis: stages.yaxis,
      margin: { l: 110, r: 20, t: 40, b: 70 }, legend: { orientation: 'h', y: -0.25 }
    }));
  }

  // A panel whose layout carries its plots' axes (domains): the offload panel (model state per
  // tier per rank, moved bytes and evictions per step) and the inference panel (tokens/s and
  // the queue over time, KV blocks per replica); hidden when the cell has no data for it.
  function renderPanel(id, panel, top) {
    const el = document.getElementById(id);
    el.hidden = !panel;
    if (!panel) { return; }
    react(id, panel.traces, Object.assign(layout(panel.title, ''), panel.layout, {
      margin: { l: 60, r: 60, t: top || (panel.title.includes('<br>') ? 60 : 40), b: 70 },
      legend: { orientation: 'h', y: -0.2, traceorder: 'normal' }
    }));
  }

  // The endpoint's line (address, state, requests/s, in flight, queue, KV) and its panel;
  // hidden when nothing serves.
  function renderEndpoint(endpoint) {
    const line = document.getElementById('endpoint-line');
    line.hidden = !endpoint;
    line.textContent = endpoint ? endpoint.line : '';
    line.dataset.status = endpoint ? endpoint.status : '';
    renderPanel('endpoint', endpoint ? endpoint.panel : null);
  }

  async function tick() {
    let delay = 2000;
    try {
      const response = await fetch(url, { credentials: 'same-origin' });
      if (response.status === 404) {
        status.textContent = 'this pool is gone (its kernel ended or it was replaced)';
        status.dataset.state = 'gone';
        delay = 5000;
      } else if (!response.ok) {
        status.textContent = 'server answered ' + response.status;
      } else {
        const doc = await response.json();
        render(doc);
        delay = doc.state === 'busy' || doc.endpoint ? 500 : 2000;
      }
    } catch (err) {
      status.textContent = 'cannot reach the server: ' + err;
    }
    setTimeout(tick, delay);
  }
  tick();
  followLabTheme();
})();
