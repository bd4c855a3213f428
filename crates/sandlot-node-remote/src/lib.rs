//! The Sandlot node API over HTTP (cluster mode, DESIGN.md "Cluster mode"): [`router`]
//! serves any [`sandlot_node_api::Node`] (a `LocalNode` in `sandlot node`), and
//! [`RemoteNode`] is the [`sandlot_node_api::Node`] a server uses to reach it.
//!
//! # Transport
//! HTTP/2 with prior knowledge (RFC 9113 §3.3) from [`RemoteNode`]: cleartext (h2c) to an
//! `http://` node ([`serve`]), inside TLS to an `https://` node ([`serve_tls`]; the node's
//! certificate is checked against the system's roots and [`RemoteOptions::tls_ca_pem`]).
//! Both also answer HTTP/1.1 (hyper-util's auto builder), which is enough for every call but
//! [`Node::exec_controlled`](sandlot_node_api::Node::exec_controlled) (full duplex needs
//! HTTP/2). Every request carries `Authorization: Bearer <token>` when the node has a token;
//! the node compares it in constant time and answers `401` without it.
//!
//! # Wire
//! Routes (all under `/v1`; `{id}` a sandbox id, `{ck}` a checkpoint id; `?path=` paths are
//! URL-encoded query parameters):
//!
//! | call | route | request body | 2xx answer |
//! |---|---|---|---|
//! | info | `GET /v1/info` | - | `NodeInfo` JSON |
//! | create | `POST /v1/sandboxes` | `SandboxSpec` JSON | `{}` |
//! | create_from_checkpoint | `POST /v1/sandboxes/from-checkpoint` | [`wire::ForkCall`] | `{}` |
//! | list | `GET /v1/sandboxes` | - | `[SandboxStatus]` |
//! | list_not_alive | `GET /v1/sandboxes?liveness=not_alive` | - | `[SandboxStatus]`, those not alive |
//! | delete | `DELETE /v1/sandboxes/{id}` | - | `{}` |
//! | pause, resume | `POST /v1/sandboxes/{id}/pause`, `/resume` | - | `{}` |
//! | pause_many, resume_many | `POST /v1/pause`, `/v1/resume` | [`wire::BulkCall`] (`{"ids": [id]}`, at most `BULK_MAX_IDS`) | `[null \| WireError]`, one per id in order |
//! | adopt_snapshot | `POST /v1/sandboxes/{id}/adopt-snapshot` | - | `{}` |
//! | exec | `POST /v1/sandboxes/{id}/exec` | [`wire::ExecCall`] | NDJSON [`wire::ExecFrame`]s |
//! | exec_controlled | `POST /v1/sandboxes/{id}/exec-controlled` | NDJSON [`wire::ControlFrame`]s | NDJSON [`wire::ExecFrame`]s |
//! | read_file | `GET /v1/sandboxes/{id}/files/content?path=&max_bytes=` | - | the bytes (`application/octet-stream`) |
//! | write_file | `PUT /v1/sandboxes/{id}/files/content?path=` | the bytes | `{}` |
//! | write_files_volatile | `POST /v1/sandboxes/{id}/files/volatile` | [`wire::VolatileFiles`] | `{}` |
//! | file_size | `GET /v1/sandboxes/{id}/files/size?path=` | - | a number (bytes) |
//! | stat_file | `GET /v1/sandboxes/{id}/files/stat?path=` | - | `FileEntry` |
//! | list_dir | `GET /v1/sandboxes/{id}/files/list?path=` | - | `[FileEntry]` |
//! | remove_file | `DELETE /v1/sandboxes/{id}/files?path=` | - | `{}` |
//! | make_dir | `POST /v1/sandboxes/{id}/files/mkdir` | [`wire::MkdirCall`] | `{}` |
//! | readopt | `POST /v1/readopt` | `{"keep": [id]}` | `[id]` |
//! | checkpoint | `POST /v1/sandboxes/{id}/checkpoints/{ck}` | - | `CheckpointMeta` |
//! | delete_checkpoint | `DELETE /v1/checkpoints/{ck}` | - | `{}` |
//! | list_checkpoints | `GET /v1/checkpoints` | - | `[ck]` |
//! | accel | `GET /v1/accel` | - | `"kvm"`, `"tcg"` or `null` |
//! | process_spawn | `POST /v1/sandboxes/{id}/processes` | `SpawnRequest` JSON | `Process` |
//! | process_list | `GET /v1/sandboxes/{id}/processes` | - | `[Process]` |
//! | process_get | `GET /v1/sandboxes/{id}/processes/{pid}` | - | `Process` |
//! | process_output | `GET /v1/sandboxes/{id}/processes/{pid}/output?stdout_offset=&stderr_offset=&follow=` | - | NDJSON `ProcessEvent`s, streamed |
//! | process_wait | `POST /v1/sandboxes/{id}/processes/{pid}/wait?timeout_ms=` | - | `Process` |
//! | process_signal | `POST /v1/sandboxes/{id}/processes/{pid}/signal` | [`wire::SignalCall`] | `{}` |
//! | process_stdin | `POST /v1/sandboxes/{id}/processes/{pid}/stdin?eof=` | the bytes | `{}` |
//! | process_resize | `POST /v1/sandboxes/{id}/processes/{pid}/resize` | `PtySize` JSON | `{}` |
//! | process_remove | `DELETE /v1/sandboxes/{id}/processes/{pid}` | - | `{}` |
//! | (health) | `GET /v1/health` | - | `{"serving": bool, ...}` (503 while fenced; [`router_gated`]) |
//!
//! A failed call answers a non-2xx status with a [`sandlot_node_api::WireError`] JSON body
//! (`{"kind": "not_found", "message": …}`; status per kind in [`status_of`]; a body or query
//! that does not parse is `invalid_argument` under 400, 413, 415 or 422), except the
//! two exec calls once their stream started: they end it with an `error` frame instead.
//! A process output stream ends with the process's `exit` (or `error`) event when it
//! ended; one that ends without it (a broken connection, or `follow=false`) is read on
//! from the offsets reached.
//! Exec streams are NDJSON (one JSON object per line): output events as they come, then
//! exactly one `result` or `error` frame; a stream that ends without one is a broken call.
//!
//! # Failures
//! [`RemoteNode`] answers [`NodeError::Transport`](sandlot_node_api::NodeError::Transport)
//! (outcome unknown) when the node cannot be reached, the connection breaks before a
//! complete answer, or the answer does not come within the call's time limit - never
//! `NotFound`: only a node that answered can say a sandbox is not there.
#![deny(missing_docs)]

mod client;
mod server;
pub mod wire;

pub use client::{NodeConnector, RemoteNode, RemoteOptions};
pub use server::{
    router, router_gated, serve, serve_tls, status_of, tls_acceptor, ServingGate, AUTH_DEADLINE,
    MAX_BODY_BYTES, MAX_CONNECTIONS, MAX_STREAMS,
};
/// The TLS side of [`serve_tls`], made by [`tls_acceptor`].
pub use tokio_native_tls::TlsAcceptor;
