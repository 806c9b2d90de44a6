//! The control socket: `/run/closbox/fabrics/<fabric>/control.sock`, mode 0600 in a 0700
//! directory, one JSON request per line (`{"cmd":"status"}`, `{"cmd":"stop"}`), one JSON
//! reply per line.
//!
//! Each connection is served by a thread of its own (at most `MAX_CLIENTS` at once), so a
//! client that connects and says nothing delays nobody; a request is at most
//! `MAX_REQUEST` bytes and must arrive within 5 s.

use std::io::{BufRead, BufReader, Read as _, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::dataplane::{Ctl, Status};
use crate::state::{FabricName, State};
use crate::sys::EventFd;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    Status,
    Stop,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reply {
    Status(Box<serde_json::Value>),
    Stopping,
    Error(String),
}

/// Clients served at once; more are told to come back.
const MAX_CLIENTS: usize = 16;
/// Longest request line.
const MAX_REQUEST: u64 = 64 << 10;

/// Starts serving; the listener thread lives as long as the process.
pub fn serve(state: State, ctl: Sender<Ctl>, wake: Arc<EventFd>) -> anyhow::Result<()> {
    let path = state.fabric.control_path();
    let _ = std::fs::remove_file(&path);
    // The socket is born 0600 (no window in which others could connect); its directory
    // is 0700 besides.
    let old = crate::sys::umask(0o177);
    let bound = UnixListener::bind(&path);
    crate::sys::umask(old);
    let listener = bound.with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let shared = Arc::new((state, Mutex::new(ctl), wake));
    let clients = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for mut conn in listener.incoming().flatten() {
                if clients.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                    clients.fetch_sub(1, Ordering::AcqRel);
                    let _ = reply(&mut conn, &Reply::Error("busy: too many clients".into()));
                    continue;
                }
                let (shared, clients) = (Arc::clone(&shared), Arc::clone(&clients));
                let spawned = std::thread::Builder::new()
                    .name("control-client".into())
                    .spawn(move || {
                        let (state, ctl, wake) = &*shared;
                        let request = read_request(&conn);
                        tracing::debug!("control: {request:?}");
                        let answer = match request {
                            Ok(Request::Status) => status(state, ctl, wake),
                            Ok(Request::Stop) => {
                                let _ = ctl.lock().expect("control lock").send(Ctl::Stop);
                                wake.notify();
                                Reply::Stopping
                            }
                            Err(e) => Reply::Error(format!("{e:#}")),
                        };
                        let _ = reply(&mut conn, &answer);
                        clients.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    tracing::warn!("control: could not start a client thread");
                }
            }
        })?;
    Ok(())
}

fn reply(conn: &mut UnixStream, r: &Reply) -> std::io::Result<()> {
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    serde_json::to_writer(&mut *conn, r)?;
    conn.write_all(b"\n")
}

fn read_request(conn: &UnixStream) -> anyhow::Result<Request> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(conn.take(MAX_REQUEST)).read_line(&mut line)?;
    if !line.ends_with('\n') && line.len() as u64 >= MAX_REQUEST {
        bail!("request longer than {MAX_REQUEST} bytes");
    }
    Ok(serde_json::from_str(line.trim())?)
}

fn status(state: &State, ctl: &Mutex<Sender<Ctl>>, wake: &EventFd) -> Reply {
    let (tx, rx) = mpsc::channel();
    if ctl
        .lock()
        .expect("control lock")
        .send(Ctl::Status(tx))
        .is_err()
    {
        return Reply::Error("the data plane has stopped".into());
    }
    wake.notify();
    let mut s: Status = match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(s) => s,
        Err(_) => return Reply::Error("the data plane did not answer within 5 s".into()),
    };
    let drops: Result<u64, _> = state
        .gpus
        .iter()
        .map(|g| crate::netns::tun_tx_dropped(g, &state.tun))
        .sum();
    s.tun_tx_dropped = drops.ok();
    match serde_json::to_value(&s) {
        Ok(v) => Reply::Status(Box::new(v)),
        Err(e) => Reply::Error(e.to_string()),
    }
}

/// Sends one request to a fabric's daemon.
pub fn request(fabric: &FabricName, req: &Request) -> anyhow::Result<Reply> {
    let path = fabric.control_path();
    let mut conn = UnixStream::connect(&path).with_context(|| {
        format!(
            "connecting to the daemon of fabric {fabric} ({})",
            path.display()
        )
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(15)))?;
    serde_json::to_writer(&mut conn, req)?;
    conn.write_all(b"\n")?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    if line.is_empty() {
        bail!("the daemon of fabric {fabric} closed the connection");
    }
    Ok(serde_json::from_str(&line)?)
}
