// A job's System panel (section#system): the series its workers sample (`sys/…`: CPU and
// memory of the trainer's process tree, its GPU's utilisation, memory, power and
// temperature), on a time axis, one chart per quantity with one curve per rank
// (`sys/rank1/cpu_percent` beside rank 0's `sys/cpu_percent`). Kept apart from the training
// charts, whose x axis is the optimizer step; hidden while the job has no such series.
import { MetricChart, color, dash } from "../chart.js";
import { fmtBytes, fmtNum, h, replace } from "../dom.js";

export const SYS_PREFIX = "sys/";
export const isSystem = (name) => name.startsWith(SYS_PREFIX);

const RANK = /^sys\/rank(\d+)\/(.+)$/;
// The quantity a series shows, in the panel's order, with its title and how a value reads.
const QUANTITIES = [
  ["cpu_percent", "CPU (100% = one core)", (v) => `${fmtNum(v)}%`],
  ["rss_bytes", "Memory (resident, whole process tree)", fmtBytes],
  ["gpu_util_percent", "GPU utilisation", (v) => `${fmtNum(v)}%`],
  ["gpu_memory_bytes", "GPU memory", fmtBytes],
  ["gpu_power_watts", "GPU power", (v) => `${fmtNum(v)} W`],
  ["gpu_temperature_c", "GPU temperature", (v) => `${fmtNum(v)} °C`],
];
const KNOWN = new Map(QUANTITIES.map(([key, title, format], i) => [key, { title, format, order: i }]));

// "sys/rank1/cpu_percent" -> { quantity: "cpu_percent", rank: 1 }.
export function parseSystem(name) {
  const m = RANK.exec(name);
  return m ? { quantity: m[2], rank: Number(m[1]) } : { quantity: name.slice(SYS_PREFIX.length), rank: 0 };
}

const guarded = (format) => (v) => (v == null || !Number.isFinite(v) ? "–" : format(v));

export function systemPanel(jobId) {
  const el = h("section", { id: "system", class: "system", hidden: true });
  const grid = h("div", { class: "charts" });
  replace(el, h("h2", {}, "System"), h("p", { class: "muted small" }, "Sampled by the workers every few seconds; x axis: time."), grid);
  const charts = new Map(); // quantity -> MetricChart

  // Charts for these series (new quantities, new ranks); the rest stay as they are.
  function update(names) {
    const byQuantity = new Map();
    for (const name of names.filter(isSystem)) {
      const { quantity, rank } = parseSystem(name);
      if (!byQuantity.has(quantity)) byQuantity.set(quantity, []);
      byQuantity.get(quantity).push({ name, rank });
    }
    const order = (q) => (KNOWN.has(q) ? KNOWN.get(q).order : KNOWN.size);
    for (const quantity of [...byQuantity.keys()].sort((a, b) => order(a) - order(b) || a.localeCompare(b))) {
      const members = byQuantity.get(quantity).sort((a, b) => a.rank - b.rank);
      const chart = charts.get(quantity);
      if (chart && members.every((m) => chart.sources.some((s) => s.name === m.name))) continue;
      const known = KNOWN.get(quantity) || { title: quantity, format: fmtNum };
      const names = new Set([...members.map((m) => m.name), ...(chart ? chart.sources.map((s) => s.name) : [])]);
      const sources = [...names].map(parseSystem).sort((a, b) => a.rank - b.rank).map(({ rank }, i) => {
        const name = rank === 0 ? `${SYS_PREFIX}${quantity}` : `${SYS_PREFIX}rank${rank}/${quantity}`;
        return { job: jobId, name, label: `rank ${rank}`, color: color(i), dash: dash(i) };
      });
      const box = h("div", { class: "chart", dataset: { quantity } });
      if (chart) { chart.destroy(); chart.el.replaceWith(box); } else grid.append(box);
      const c = new MetricChart(box, { title: known.title, sources, time: true, format: guarded(known.format) });
      charts.set(quantity, c);
      c.load().catch((e) => { box.dataset.error = e.message; });
    }
    el.hidden = charts.size === 0;
  }

  // A live point from the job's event stream; false when no chart has its series yet.
  function append(m) {
    const chart = charts.get(parseSystem(m.name).quantity);
    return !!chart && chart.append(jobId, m.name, m.step, m.value);
  }

  const names = () => [...charts.values()].flatMap((c) => c.sources.map((s) => s.name));
  return {
    el, update, append, names,
    load: () => { for (const c of charts.values()) c.load().catch(() => {}); },
    destroy: () => { for (const c of charts.values()) c.destroy(); },
  };
}
