//! `sandlot shell SANDBOX [-- CMD…]`: an interactive terminal in a sandbox.
//!
//! Built on the background-process API with a terminal (docs/api.md, "Terminals"): the
//! command is spawned with `pty` set to the local window size (`TIOCGWINSZ`), `TERM` copied
//! from the local environment (default `xterm-256color`); the local terminal is put in raw
//! mode (termios `cfmakeraw`, restored on every way out), typed bytes go to
//! `…/processes/{pid}/stdin` as they come, the terminal's output (`…/output?follow=true`)
//! is written to stdout as it comes, and SIGWINCH sends `…/resize`. The shell's exit code
//! is the command's. With stdin not a terminal (a pipe), the bytes are typed in as they
//! are and the end of input is typed as Ctrl-D (the terminal's end-of-file key), again each
//! second until the command exits.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;

use anyhow::Context;
use futures::StreamExt;
use nix::sys::termios::{self, SetArg, Termios};
use sandlot_api::{ApiError, Cmd, ErrorCode, ProcessEvent, PtySize, SpawnRequest};
use sandlot_client::{Client, ClientError};

/// The command of a shell without `-- CMD`: a login bash where the image has one, else sh.
const DEFAULT_SHELL: &str = "command -v bash >/dev/null 2>&1 && exec bash -l; exec sh -l";
/// The terminal size when stdin is not a terminal.
const DEFAULT_SIZE: PtySize = PtySize { rows: 24, cols: 80 };
/// Ctrl-D: the end-of-file key of a terminal in canonical mode.
const EOF_KEY: u8 = 0x04;
/// How often the end of piped input is typed again while the command runs.
const EOF_REPEAT: std::time::Duration = std::time::Duration::from_secs(1);
/// Reconnects of the output stream after a transport error, from the offsets reached.
const OUTPUT_RECONNECTS: u32 = 3;

/// Runs the shell; returns the command's exit code (0–255).
///
/// # Errors
/// The spawn's API error (`not_found`, `conflict` for a paused sandbox, ...), a stream
/// that broke [`OUTPUT_RECONNECTS`] times, or an `error` event of the process.
pub async fn shell(c: &Client, id: &str, cmd: Vec<String>) -> anyhow::Result<u8> {
    let tty = std::io::stdin().is_terminal();
    let size = if tty { window_size() } else { None };
    let term = std::env::var("TERM")
        .ok()
        .filter(|t| !t.is_empty() && t != "dumb")
        .unwrap_or_else(|| "xterm-256color".into());
    let req = SpawnRequest {
        cmd: if cmd.is_empty() {
            Cmd::Shell(DEFAULT_SHELL.into())
        } else {
            Cmd::Argv(cmd)
        },
        cwd: None,
        env: [("TERM".to_string(), term)].into(),
        stdin_b64: None,
        stdin: true,
        timeout_s: None,
        max_output_bytes: None,
        user: None,
        pty: Some(size.unwrap_or(DEFAULT_SIZE)),
        tag: None,
        meta: None,
    };
    let p = c.spawn(id, &req).await?;
    let raw = if tty { Some(RawMode::enter()?) } else { None };
    let typing = tokio::spawn(type_stdin(c.clone(), id.to_owned(), p.id.clone()));
    let resizing = tty.then(|| tokio::spawn(follow_window(c.clone(), id.to_owned(), p.id.clone())));
    let out = relay_output(c, id, &p.id).await;
    typing.abort();
    if let Some(r) = resizing {
        r.abort();
    }
    drop(raw);
    if out.is_err() {
        // Do not leave the command running behind a shell that gave up.
        let _ = c.delete_process(id, &p.id).await;
    }
    out
}

/// Writes the terminal's output to stdout until the `exit` event; returns its exit code.
async fn relay_output(c: &Client, id: &str, pid: &str) -> anyhow::Result<u8> {
    let mut offsets = (0u64, 0u64);
    let mut reconnects = 0;
    let mut stdout = std::io::stdout();
    loop {
        let mut s = c.process_output(id, pid, offsets, true).await?;
        while let Some(ev) = s.next().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(ClientError::Transport { .. }) if reconnects < OUTPUT_RECONNECTS => break,
                Err(e) => return Err(e.into()),
            };
            match ev {
                ProcessEvent::Stdout {
                    data,
                    data_b64,
                    offset,
                } => {
                    let bytes = crate::raw(&data, data_b64);
                    offsets.0 = offset + bytes.len() as u64;
                    stdout.write_all(&bytes)?;
                    stdout.flush()?;
                }
                ProcessEvent::Stderr {
                    data,
                    data_b64,
                    offset,
                } => {
                    let bytes = crate::raw(&data, data_b64);
                    offsets.1 = offset + bytes.len() as u64;
                    std::io::stderr().write_all(&bytes)?;
                }
                ProcessEvent::Skipped { .. } => {}
                ProcessEvent::Exit { result } => return Ok(result.exit_code.clamp(0, 255) as u8),
                ProcessEvent::Error { error } => return Err(ClientError::Api(error).into()),
            }
        }
        reconnects += 1;
        if reconnects > OUTPUT_RECONNECTS {
            return Err(ClientError::Api(ApiError::new(
                ErrorCode::Unavailable,
                format!("the output of terminal {pid} ended without its exit record"),
            ))
            .into());
        }
    }
}

/// Sends what is typed (read on a thread of its own: stdin reads block) to the process's
/// stdin, batching what queued up meanwhile into one call; the end of input is typed as
/// Ctrl-D, again every [`EOF_REPEAT`] until the command exits.
async fn type_stdin(c: Client, id: String, pid: String) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    // Typed again each second: a program that switched the terminal's
                    // mode after the key arrived (a REPL starting up) can lose it.
                    while tx.blocking_send(vec![EOF_KEY]).is_ok() {
                        std::thread::sleep(EOF_REPEAT);
                    }
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    while let Some(mut keys) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            keys.extend(more);
        }
        if c.process_stdin(&id, &pid, keys, false).await.is_err() {
            return; // exited (or gone): the output stream reports how
        }
    }
}

/// Sends the local window size on each SIGWINCH.
async fn follow_window(c: Client, id: String, pid: String) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut winch) = signal(SignalKind::window_change()) else {
        return;
    };
    while winch.recv().await.is_some() {
        if let Some(size) = window_size() {
            let _ = c.process_resize(&id, &pid, size).await;
        }
    }
}

/// The local terminal's size (`TIOCGWINSZ` on stdout, else stdin), clamped to the API's
/// 1..=1000; `None` when neither is a terminal.
fn window_size() -> Option<PtySize> {
    [nix::libc::STDOUT_FILENO, nix::libc::STDIN_FILENO]
        .into_iter()
        .find_map(|fd| {
            let mut ws = nix::libc::winsize {
                ws_row: 0,
                ws_col: 0,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            // SAFETY: TIOCGWINSZ writes one `winsize` into the pointer given.
            let rc = unsafe { nix::libc::ioctl(fd, nix::libc::TIOCGWINSZ, &mut ws) };
            (rc == 0).then_some(())?;
            (ws.ws_row > 0 && ws.ws_col > 0).then(|| PtySize {
                rows: ws.ws_row.min(1000),
                cols: ws.ws_col.min(1000),
            })
        })
}

/// The local terminal in raw mode (no echo, no line editing, no signals from keys: Ctrl-C
/// reaches the sandbox's terminal) until dropped.
struct RawMode(Termios);

impl RawMode {
    fn enter() -> anyhow::Result<RawMode> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd()).context("tcgetattr on stdin")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).context("tcsetattr on stdin")?;
        Ok(RawMode(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.0);
    }
}
