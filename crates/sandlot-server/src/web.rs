//! `GET /`: a status page for operators: node (`/healthz`), sandboxes by state and backend,
//! the sandboxes themselves, and recent audit events ([`crate::events`]).
//!
//! The first render is done here (escaped with [`escape`]); a small inline script then
//! refreshes every 2 s from `/healthz`, `/v1/sandboxes` and `/v1/events`. No build step.
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
text-overflow:ellipsis;white-space:nowrap}th{background:#f3f3f3}#err{color:#b00}";

// Only textContent and createElement: data never becomes markup.
const SCRIPT: &str = r#"
function cell(tr, text, tag) { const c = document.createElement(tag || 'td'); c.textContent = text == null ? '' : String(text); tr.appendChild(c); }
function fill(id, head, rows) {
  const t = document.getElementById(id); t.replaceChildren();
  const h = document.createElement('tr'); head.forEach(x => cell(h, x, 'th')); t.appendChild(h);
  rows.forEach(r => { const tr = document.createElement('tr'); r.forEach(x => cell(tr, x)); t.appendChild(tr); });
}
async function j(u) { const r = await fetch(u, {cache: 'no-store'}); if (!r.ok) throw new Error(u + ': HTTP ' + r.status); return r.json(); }
async function refresh() {
  try {
    const [h, l, e] = await Promise.all([j('/healthz'), j('/v1/sandboxes'), j('/v1/events?limit=50')]);
    document.getElementById('node').textContent = h.node + ' · cgroup ' + h.cgroup_version + ' · v' + h.version;
    fill('backends', ['backend', 'status'], Object.entries(h.backends));
    const by = {}; let traj = 0;
    l.sandboxes.forEach(s => { const k = s.backend + '\u0000' + s.state; by[k] = (by[k] || 0) + 1; if (s.trajectory) traj++; });
    fill('bystate', ['backend', 'state', 'count'], Object.entries(by).sort().map(([k, n]) => k.split('\u0000').concat([n])));
    document.getElementById('traj').textContent = String(traj);
    fill('sandboxes', ['id', 'backend', 'state', 'image', 'labels', 'expires'],
      l.sandboxes.map(s => [s.id, s.backend, s.state, s.image, JSON.stringify(s.labels || {}), s.expires_at]));
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

/// `GET /` → the status page (text/html).
pub async fn index(State(st): State<SharedState>) -> ApiResult<impl IntoResponse> {
    let records = st.store.list().await?;
    let mut by: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut rows = Vec::new();
    let mut traj = 0;
    for r in &records {
        *by.entry((r.backend.as_str().into(), r.state.as_str().into()))
            .or_default() += 1;
        traj += usize::from(r.spec.trajectory.is_some());
        let api = r.to_api();
        rows.push(vec![
            api.id,
            r.backend.as_str().into(),
            r.state.as_str().into(),
            api.image,
            serde_json::to_string(&api.labels).unwrap_or_default(),
            api.expires_at.unwrap_or_default(),
        ]);
    }
    let by_rows: Vec<Vec<String>> = by
        .into_iter()
        .map(|((b, s), n)| vec![b, s, n.to_string()])
        .collect();
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Sandlot</title>\
         <style>{STYLE}</style></head><body><h1>Sandlot</h1>\
         <p>Node <b id=\"node\">{}</b> · updated <span id=\"updated\">(server render)</span> \
         <span id=\"err\"></span></p><h2>Backends</h2><table id=\"backends\"></table>\
         <h2>Sandboxes by backend and state</h2>",
        escape(&st.node_name)
    );
    table(
        &mut html,
        "bystate",
        &["backend", "state", "count"],
        &by_rows,
    );
    let _ = write!(
        html,
        "<p>Sandboxes bound to a trajectory: <b id=\"traj\">{traj}</b></p><h2>Sandboxes</h2>"
    );
    table(
        &mut html,
        "sandboxes",
        &["id", "backend", "state", "image", "labels", "expires"],
        &rows,
    );
    html.push_str("<h2>Recent events (newest first)</h2><table id=\"events\"></table>");
    let _ = write!(html, "<script>{SCRIPT}</script></body></html>");
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
