//! `GET /`: a status page for operators: node (`/healthz`), in cluster mode the cluster
//! (every node with its kind — `simulated` or `real` — state, start time, capacity vs usage
//! bars for sandboxes / cpu / memory, backends, and its sandboxes in this server's
//! registry; totals above), sandboxes by state and backend, the sandboxes themselves (the
//! first [`MAX_ROWS`]), and recent audit events ([`crate::events`]).
//!
//! The first render is done here (escaped with [`escape`]); a small inline script then
//! refreshes every 2 s from `/healthz`, `/v1/nodes`, `/v1/sandboxes:summary` (counts),
//! the first page of `/v1/sandboxes` and `/v1/events`. No build step. Neither the render
//! nor a refresh reads every record: at 384,000 sandboxes a refresh is a few indexed counts
//! and one page.
//!
//! SECURITY: labels, images, trajectory ids and error messages are written by clients
//! (often model-written code). The server escapes every value it puts in HTML, the script
//! only ever sets `textContent` (never `innerHTML` with data), and the page is served with a
//! Content-Security-Policy that allows no external script, no frames and only same-origin
//! fetches, so a value that slipped through still could not run or exfiltrate.
use crate::error::ApiResult;
use crate::SharedState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The Content-Security-Policy of the page (see module docs).
pub const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
connect-src 'self'; img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The charts of the last 10 minutes ([`crate::timeline`]), drawn by the script.
const CHARTS: &str = "<h2>Last 10 minutes (this server, 10 s buckets, now at the right)</h2>\
<figure><figcaption>node creates/s · <span id=\"chart-creates-max\"></span></figcaption>\
<svg id=\"chart-creates\" class=\"chart\" width=\"600\" height=\"80\"></svg></figure>\
<figure><figcaption>exec latency ms, <span class=\"p50\">p50</span> / <span class=\"p99\">p99</span> · \
<span id=\"chart-exec-max\"></span></figcaption>\
<svg id=\"chart-exec\" class=\"chart\" width=\"600\" height=\"80\"></svg></figure>";

/// HTML-escape text for element content and quoted attribute values.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}\
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.5em}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;\
font-family:ui-monospace,monospace;font-size:12px;max-width:40em;overflow:hidden;\
text-overflow:ellipsis;white-space:nowrap}th{background:#f3f3f3}#err{color:#b00}\
.bar{display:inline-block;width:90px;height:9px;background:#e6e6e6;margin-right:6px;\
vertical-align:middle}.bar>span{display:block;height:9px;background:#3a7bd5}.bar.full>span{background:#c0392b}\
.sim{color:#8a5a00;background:#fff4d6;padding:0 4px}.real{color:#1d6b2a;background:#e3f6e6;\
padding:0 4px}#totals b{margin-right:1.2em}\
.chart{background:#f7f7f7;border:1px solid #ddd}figure{margin:0.5em 0}figcaption{font-size:12px;color:#555}\
.p50{color:#37b}.p99{color:#b53}";

/// Most sandboxes listed one per row (the page stays light with thousands of them; the
/// counts above cover all).
pub const MAX_ROWS: usize = 500;

// Only textContent and createElement: data never becomes markup.
const SCRIPT: &str = r#"
function cell(tr, text, tag) { const c = document.createElement(tag || 'td'); c.textContent = text == null ? '' : String(text); tr.appendChild(c); }
function fill(id, head, rows) {
  const t = document.getElementById(id); t.replaceChildren();
  const h = document.createElement('tr'); head.forEach(x => cell(h, x, 'th')); t.appendChild(h);
  rows.forEach(r => { const tr = document.createElement('tr'); r.forEach(x => cell(tr, x)); t.appendChild(tr); });
}
function bar(td, used, cap, text) {
  const b = document.createElement('span'); b.className = 'bar' + (cap > 0 && used >= cap ? ' full' : '');
  const f = document.createElement('span'); f.style.width = (cap > 0 ? Math.min(100, 100 * used / cap) : 0).toFixed(1) + '%';
  b.appendChild(f); td.appendChild(b); td.appendChild(document.createTextNode(text));
}
function kind(td, sim) { const k = document.createElement('span'); k.className = sim ? 'sim' : 'real'; k.textContent = sim ? 'simulated' : 'real'; td.appendChild(k); }
function cluster(nodes, per) {
  const t = document.getElementById('nodes'); t.replaceChildren();
  const h = document.createElement('tr'); NODE_HEAD.forEach(x => cell(h, x, 'th')); t.appendChild(h);
  const tot = {n: 0, sim: 0, sb: 0, sbc: 0, cpu: 0, cpuc: 0, mem: 0, memc: 0, reg: 0};
  nodes.forEach(x => {
    const c = x.capacity || {}, u = x.usage || {};
    tot.n++; tot.sim += x.simulated ? 1 : 0; tot.sb += u.sandboxes || 0; tot.sbc += c.sandboxes || 0;
    tot.cpu += u.cpu || 0; tot.cpuc += c.cpu || 0; tot.mem += u.memory_mib || 0; tot.memc += c.memory_mib || 0; tot.reg += per[x.name] || 0;
    const tr = document.createElement('tr');
    cell(tr, x.name);
    const k = document.createElement('td'); kind(k, x.simulated); tr.appendChild(k);
    cell(tr, c.sandboxes > 0 && u.sandboxes >= c.sandboxes ? 'full' : 'ready');
    cell(tr, x.started_at);
    let td = document.createElement('td'); bar(td, u.sandboxes || 0, c.sandboxes || 0, (u.sandboxes || 0) + ' / ' + (c.sandboxes || 0)); tr.appendChild(td);
    td = document.createElement('td'); bar(td, u.cpu || 0, c.cpu || 0, (u.cpu || 0).toFixed(1) + ' / ' + (c.cpu || 0).toFixed(1)); tr.appendChild(td);
    td = document.createElement('td'); bar(td, u.memory_mib || 0, c.memory_mib || 0, Math.round((u.memory_mib || 0) / 1024) + ' / ' + Math.round((c.memory_mib || 0) / 1024) + ' GiB'); tr.appendChild(td);
    cell(tr, (x.backends || []).join(' '));
    cell(tr, per[x.name] || 0);
    t.appendChild(tr);
  });
  const T = document.getElementById('totals'); T.replaceChildren();
  [['nodes', tot.n + ' (' + tot.sim + ' simulated, ' + (tot.n - tot.sim) + ' real)'],
   ['sandboxes', tot.sb + ' / ' + tot.sbc], ['cpu', tot.cpu.toFixed(1) + ' / ' + tot.cpuc.toFixed(1) + ' cores'],
   ['memory', Math.round(tot.mem / 1024) + ' / ' + Math.round(tot.memc / 1024) + ' GiB'], ['in this registry', tot.reg]
  ].forEach(([k, v]) => { const b = document.createElement('b'); b.textContent = k + ': ' + v; T.appendChild(b); });
}
function chart(id, pts, series) {
  // Bars per 10 s bucket, one colour per series, scaled to the largest value shown.
  const svg = document.getElementById(id), NS = 'http://www.w3.org/2000/svg';
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 600, H = 80, w = W / Math.max(pts.length, 1);
  let max = 0; pts.forEach(p => series.forEach(([k]) => { max = Math.max(max, p[k] || 0); }));
  series.forEach(([k, colour], si) => pts.forEach((p, i) => {
    const v = p[k] || 0; if (!v) return;
    const r = document.createElementNS(NS, 'rect'), h = Math.max(1, v / max * (H - 2));
    r.setAttribute('x', String(i * w + si * w / series.length)); r.setAttribute('width', String(Math.max(1, w / series.length - 1)));
    r.setAttribute('y', String(H - h)); r.setAttribute('height', String(h)); r.setAttribute('fill', colour);
    const t = document.createElementNS(NS, 'title'); t.textContent = new Date(p.t * 1000).toISOString() + ' ' + k + ' ' + v; r.appendChild(t);
    svg.appendChild(r);
  }));
  document.getElementById(id + '-max').textContent = 'max ' + (Math.round(max * 10) / 10);
}
async function j(u) { const r = await fetch(u, {cache: 'no-store'}); if (!r.ok) throw new Error(u + ': HTTP ' + r.status); return r.json(); }
async function refresh() {
  try {
    const [h, sum, l, e, n, tl] = await Promise.all([j('/healthz'), j('/v1/sandboxes:summary'), j('/v1/sandboxes?limit=' + MAX_ROWS), j('/v1/events?limit=50'), j('/v1/nodes'), j('/v1/timeline')]);
    if (n.cluster) cluster(n.nodes, sum.by_node);
    chart('chart-creates', tl.points, [['creates_per_s', '#3b7']]);
    chart('chart-exec', tl.points, [['exec_p50_ms', '#37b'], ['exec_p99_ms', '#b53']]);
    document.getElementById('node').textContent = h.node + ' · cgroup ' + h.cgroup_version + ' · v' + h.version;
    fill('backends', ['backend', 'status'], Object.entries(h.backends));
    fill('bystate', ['backend', 'state', 'count'], sum.by_state.map(c => [c.backend, c.state, c.count]).sort());
    document.getElementById('traj').textContent = String(sum.with_trajectory);
    fill('sandboxes', ['id', 'backend', 'state', 'node', 'image', 'labels', 'expires'],
      l.sandboxes.map(s => [s.id, s.backend, s.state, s.node, s.image, JSON.stringify(s.labels || {}), s.expires_at]));
    document.getElementById('shown').textContent = sum.total > l.sandboxes.length ? ('first ' + l.sandboxes.length + ' of ' + sum.total) : ('all ' + sum.total);
    fill('events', ['id', 'time', 'kind', 'sandbox', 'backend', 'detail'],
      e.events.slice().reverse().map(v => { const {id, time, kind, sandbox, backend, ...rest} = v; return [id, time, kind, sandbox, backend, JSON.stringify(rest)]; }));
    document.getElementById('err').textContent = '';
    document.getElementById('updated').textContent = new Date().toISOString();
  } catch (x) { document.getElementById('err').textContent = 'refresh failed: ' + x; }
}
refresh(); setInterval(refresh, 2000);
"#;

fn table(out: &mut String, id: &str, head: &[&str], rows: &[Vec<String>]) {
    let _ = write!(out, "<table id=\"{id}\"><tr>");
    for h in head {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr>");
    for r in rows {
        out.push_str("<tr>");
        for c in r {
            let _ = write!(out, "<td>{}</td>", escape(c));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
}

/// Column heads of the cluster's node table (server render and script).
const NODE_HEAD: [&str; 9] = [
    "node",
    "kind",
    "state",
    "started",
    "sandboxes (usage / capacity)",
    "cpu",
    "memory",
    "backends",
    "in this registry",
];

/// A usage bar (`used` of `cap`, full in red) and its text, as cell HTML.
fn bar(used: f64, cap: f64, text: &str) -> String {
    let pct = if cap > 0.0 {
        (100.0 * used / cap).clamp(0.0, 100.0)
    } else {
        0.0
    };
    let full = if cap > 0.0 && used >= cap {
        " full"
    } else {
        ""
    };
    format!(
        "<span class=\"bar{full}\"><span style=\"width:{pct:.1}%\"></span></span>{}",
        escape(text)
    )
}

/// The cluster section: totals and one row per node, `simulated` or `real` labelled.
fn cluster_html(out: &mut String, nodes: &sandlot_cluster::Nodes, per_node: &BTreeMap<&str, u64>) {
    let sim = nodes.values().filter(|n| n.simulated).count();
    let (mut sb, mut sbc, mut cpu, mut cpuc, mut mem, mut memc) =
        (0u64, 0u64, 0.0, 0.0, 0u64, 0u64);
    for n in nodes.values() {
        sb += n.usage.sandboxes;
        sbc += n.capacity.sandboxes;
        cpu += n.usage.cpu;
        cpuc += n.capacity.cpu;
        mem += n.usage.memory_mib;
        memc += n.capacity.memory_mib;
    }
    let reg: u64 = nodes
        .keys()
        .map(|k| per_node.get(k.as_str()).copied().unwrap_or(0))
        .sum();
    let _ = write!(
        out,
        "<h2>Cluster</h2><p id=\"totals\"><b>nodes: {} ({sim} simulated, {} real)</b>\
         <b>sandboxes: {sb} / {sbc}</b><b>cpu: {cpu:.1} / {cpuc:.1} cores</b>\
         <b>memory: {} / {} GiB</b><b>in this registry: {reg}</b></p>\
         <table id=\"nodes\"><tr>",
        nodes.len(),
        nodes.len() - sim,
        mem / 1024,
        memc / 1024,
    );
    for h in NODE_HEAD {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr>");
    for n in nodes.values() {
        let (u, c) = (&n.usage, &n.capacity);
        let state = if c.sandboxes > 0 && u.sandboxes >= c.sandboxes {
            "full"
        } else {
            "ready"
        };
        let kind = if n.simulated {
            "<span class=\"sim\">simulated</span>"
        } else {
            "<span class=\"real\">real</span>"
        };
        let backends: Vec<&str> = n.backends.iter().map(|b| b.as_str()).collect();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{kind}</td><td>{state}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&n.name),
            escape(&n.started_at),
            bar(
                u.sandboxes as f64,
                c.sandboxes as f64,
                &format!("{} / {}", u.sandboxes, c.sandboxes)
            ),
            bar(u.cpu, c.cpu, &format!("{:.1} / {:.1}", u.cpu, c.cpu)),
            bar(
                u.memory_mib as f64,
                c.memory_mib as f64,
                &format!("{} / {} GiB", u.memory_mib / 1024, c.memory_mib / 1024)
            ),
            escape(&backends.join(" ")),
            per_node.get(n.name.as_str()).copied().unwrap_or(0),
        );
    }
    out.push_str("</table>");
}

/// `GET /` → the status page (text/html).
pub async fn index(State(st): State<SharedState>) -> ApiResult<impl IntoResponse> {
    let summary = st.store.summary().await?;
    let first = st
        .store
        .list_page(&BTreeMap::new(), None, None, MAX_ROWS)
        .await?;
    let total: u64 = summary.by_state.iter().map(|c| c.2).sum();
    let per_node: BTreeMap<&str, u64> = summary
        .by_node
        .iter()
        .map(|(n, c)| (n.as_str(), *c))
        .collect();
    let traj = summary.with_trajectory;
    let mut rows = Vec::new();
    for r in &first {
        let api = r.to_api();
        rows.push(vec![
            api.id,
            r.backend.as_str().into(),
            r.state.as_str().into(),
            r.node.clone(),
            api.image,
            serde_json::to_string(&api.labels).unwrap_or_default(),
            api.expires_at.unwrap_or_default(),
        ]);
    }
    let mut by_rows: Vec<Vec<String>> = summary
        .by_state
        .iter()
        .map(|(b, s, n)| vec![b.clone(), s.clone(), n.to_string()])
        .collect();
    by_rows.sort();
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Sandlot</title>\
         <style>{STYLE}</style></head><body><h1>Sandlot</h1>\
         <p>Node <b id=\"node\">{}</b> · updated <span id=\"updated\">(server render)</span> \
         <span id=\"err\"></span></p>{CHARTS}",
        escape(&st.node_name)
    );
    if let Some(c) = st.cluster.get() {
        cluster_html(&mut html, &c.nodes(), &per_node);
    }
    html.push_str(
        "<h2>Backends</h2><table id=\"backends\"></table><h2>Sandboxes by backend and state</h2>",
    );
    table(
        &mut html,
        "bystate",
        &["backend", "state", "count"],
        &by_rows,
    );
    let shown = if total > first.len() as u64 {
        format!("first {} of {total}", first.len())
    } else {
        format!("all {total}")
    };
    let _ = write!(
        html,
        "<p>Sandboxes bound to a trajectory: <b id=\"traj\">{traj}</b></p>\
         <h2>Sandboxes (<span id=\"shown\">{shown}</span>)</h2>"
    );
    table(
        &mut html,
        "sandboxes",
        &[
            "id", "backend", "state", "node", "image", "labels", "expires",
        ],
        &rows,
    );
    html.push_str("<h2>Recent events (newest first)</h2><table id=\"events\"></table>");
    let head = serde_json::to_string(&NODE_HEAD).unwrap_or_default();
    let _ = write!(
        html,
        "<script>const MAX_ROWS = {MAX_ROWS}; const NODE_HEAD = {head};{SCRIPT}</script></body></html>"
    );
    Ok((
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        html,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_cluster::{NodeRecord, Resources};

    #[test]
    fn cluster_section_labels_simulated_nodes_and_escapes() {
        let evil = "<img src=x onerror=alert(1)>";
        let mut nodes = BTreeMap::new();
        for (name, simulated, used) in [("sim-000", true, 5), ("real-1", false, 2)] {
            nodes.insert(
                name.to_owned(),
                std::sync::Arc::new(NodeRecord {
                    name: name.into(),
                    simulated,
                    started_at: evil.into(),
                    capacity: Resources {
                        cpu: 20.0,
                        memory_mib: 40960,
                        sandboxes: 5,
                    },
                    usage: Resources {
                        cpu: 0.5,
                        memory_mib: 320,
                        sandboxes: used,
                    },
                    ..Default::default()
                }),
            );
        }
        let per_node = BTreeMap::from([("sim-000", 5), ("real-1", 2)]);
        let mut html = String::new();
        cluster_html(&mut html, &nodes, &per_node);
        assert!(html.contains("nodes: 2 (1 simulated, 1 real)"), "{html}");
        assert!(html.contains("<span class=\"sim\">simulated</span>"));
        assert!(html.contains("<span class=\"real\">real</span>"));
        assert!(html.contains("sandboxes: 7 / 10"));
        assert!(html.contains("<td>full</td>") && html.contains("<td>ready</td>"));
        assert!(html.contains("class=\"bar full\"><span style=\"width:100.0%\">"));
        assert!(!html.contains(evil) && html.contains("&lt;img src=x"));
    }
}
