//! The control socket: `/run/closbox/<fabric>/control.sock`, mode 0600, one JSON request
//! per line (`{"cmd":"status"}`, `{"cmd":"stop"}`), one JSON reply per line.
//!
//! Served by a plain thread: requests are rare and short. (The control API that is to come
//! — chaos, telemetry streams, a live view — is where an async runtime will pay off.)

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::dataplane::{Ctl, Status};
use crate::state::{control_path, State};
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

/// Starts serving; the listener thread lives as long as the process.
pub fn serve(state: State, ctl: Sender<Ctl>, wake: Arc<EventFd>) -> anyhow::Result<()> {
    let path = control_path(&state.fabric);
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let ctl = Mutex::new(ctl);
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let reply = match read_request(&conn) {
                    Ok(Request::Status) => status(&state, &ctl, &wake),
                    Ok(Request::Stop) => {
                        let _ = ctl.lock().expect("control lock").send(Ctl::Stop);
                        wake.notify();
                        Reply::Stopping
                    }
                    Err(e) => Reply::Error(format!("{e:#}")),
                };
                let mut conn = conn;
                let _ = serde_json::to_writer(&mut conn, &reply);
                let _ = conn.write_all(b"\n");
            }
        })?;
    Ok(())
}

fn read_request(conn: &UnixStream) -> anyhow::Result<Request> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line)?;
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
pub fn request(fabric: &str, req: &Request) -> anyhow::Result<Reply> {
    let path = control_path(fabric);
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
