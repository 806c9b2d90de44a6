//! `closbox link|switch|gpu …` and `closbox events`: changes to a live fabric through its
//! daemon, and the log of what changed when.

use std::process::ExitCode;

use anyhow::bail;
use closbox_switchd::control::{self, ChangeRequest, Event, Reply, Request};
use closbox_switchd::state::FabricName;

use crate::live;

/// Asks the daemon of the fabric for `req`; prints what it applied.
pub fn change(fabric: Option<&FabricName>, req: ChangeRequest) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox link/switch/gpu")?;
    let st = live::resolve(fabric)?;
    match control::request(&st.fabric, &Request::Change(req))? {
        Reply::Changed { events } => {
            for e in &events {
                println!("{}", line(e));
            }
            Ok(ExitCode::SUCCESS)
        }
        // Names and values are checked by the daemon against the fabric: bad arguments.
        Reply::Error { message } => Err(crate::usage(message)),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// `closbox partition SEL…`: selections resolved against the fabric, sent as names.
pub fn partition(fabric: Option<&FabricName>, sels: &[String]) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox partition")?;
    let st = live::resolve(fabric)?;
    let groups = sels
        .iter()
        .map(|sel| {
            Ok(live::select(&st, sel)?
                .into_iter()
                .map(|i| st.gpus[i].name.clone())
                .collect())
        })
        .collect::<anyhow::Result<Vec<Vec<String>>>>()?;
    change(Some(&st.fabric), ChangeRequest::Partition { groups })
}

pub fn events(fabric: Option<&FabricName>, json: bool) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox events")?;
    let st = live::resolve(fabric)?;
    match control::request(&st.fabric, &Request::Events)? {
        Reply::Events { events } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&events)?);
            } else if events.is_empty() {
                println!("fabric {}: no changes since it came up", st.fabric);
            } else {
                for e in &events {
                    println!("{}", line(e));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// "fabric time 1.234567 s  (wall 12:34:56.789)  link leaf0-spine0 #0 down".
fn line(e: &Event) -> String {
    let ms = e.wall_ms % 86_400_000;
    format!(
        "fabric time {:.6} s  (wall {:02}:{:02}:{:02}.{:03} UTC)  {}",
        e.fabric_ns as f64 / 1e9,
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000,
        e.what
    )
}
