//! `closbox flows`: per 5-tuple, what the fabric carried, dropped and marked, and the path
//! the fabric hashes it onto — where ECMP collisions show.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::bail;
use closbox_switchd::control::{self, Flows, Reply, Request};
use closbox_switchd::state::FabricName;

use crate::live;
use crate::plan::approx_bytes;

pub fn flows(
    fabric: Option<&FabricName>,
    top: usize,
    since: Option<closbox_fabric::Duration>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox flows")?;
    let st = live::resolve(fabric)?;
    // The daemon cuts to the heaviest `top` itself: it works out paths for those only.
    let req = Request::Flows {
        top,
        since_ns: since.map(|d| d.as_nanos()),
    };
    let f = match control::request(&st.fabric, &req)? {
        Reply::Flows(f) => *f,
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    };
    let total = f.flows_total as usize;
    if json {
        // With `flows_total`: how many there were before --top.
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        print!("{}", render(&st.fabric, &f, total, since));
    }
    Ok(ExitCode::SUCCESS)
}

/// `f` holds the heaviest of `total` flows.
fn render(
    fabric: &FabricName,
    f: &Flows,
    total: usize,
    since: Option<closbox_fabric::Duration>,
) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "fabric {fabric}, fabric time {:.6} s: {total} flow{}{}{} (heaviest first; counters from each flow's first packet)",
        f.fabric_time_s,
        if total == 1 { "" } else { "s" },
        since.map_or(String::new(), |d| format!(" active in the last {d}")),
        if f.flows.len() < total {
            format!(", the {} heaviest shown (--top)", f.flows.len())
        } else {
            String::new()
        },
    );
    if f.flows.is_empty() {
        return o;
    }
    let _ = writeln!(
        o,
        "{:<5} {:<27} {:<27} {:>10} {:>10} {:>8} {:>8}  path",
        "proto", "from", "to", "packets", "bytes", "drops", "ecn"
    );
    for x in &f.flows {
        let end = |gpu: &str, addr: &str, port: u16| {
            let who = if gpu.is_empty() { addr } else { gpu };
            if port == 0 {
                who.to_owned()
            } else {
                format!("{who}:{port}")
            }
        };
        let _ = writeln!(
            o,
            "{:<5} {:<27} {:<27} {:>10} {:>10} {:>8} {:>8}  {}",
            x.proto,
            end(&x.src_gpu, &x.src, x.sport),
            end(
                if x.dst_switch.is_empty() {
                    &x.dst_gpu
                } else {
                    &x.dst_switch
                },
                &x.dst,
                x.dport
            ),
            x.packets,
            approx_bytes(x.bytes),
            x.drops,
            x.ecn_marked,
            if x.path.is_empty() {
                "(per packet)".to_owned()
            } else {
                path_line(&x.path, &x.ports)
            }
        );
    }
    if f.retired_flows > 0 {
        let _ = writeln!(
            o,
            "({} earlier flows ({} packets) no longer listed: beyond {} flows, those least recently active are let go)",
            crate::plan::thousands(f.retired_flows),
            crate::plan::thousands(f.retired_packets),
            crate::plan::thousands(closbox_switchd::dataplane::MAX_FLOWS as u64)
        );
    }
    o
}

/// "gpu0 > leaf0 >#4 spine1 >#5 leaf1 > gpu3": the vertices a flow crosses, and where
/// parallel links join two of them, the index of the link it is hashed onto (two flows
/// from leaf0 to spine1 collide only on the same one).
fn path_line(path: &[String], ports: &[String]) -> String {
    let mut line = path.first().cloned().unwrap_or_default();
    for (i, v) in path.iter().enumerate().skip(1) {
        match ports.get(i - 1).and_then(|p| p.split_once(" #")) {
            Some((_, index)) => line += &format!(" >#{index} {v}"),
            None => line += &format!(" > {v}"),
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_names_the_parallel_link_a_flow_is_hashed_onto() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let path = s(&["gpu0", "leaf0", "spine1", "leaf1", "gpu3"]);
        let ports = s(&[
            "gpu0->leaf0",
            "leaf0->spine1 #4",
            "spine1->leaf1 #5",
            "leaf1->gpu3",
        ]);
        assert_eq!(
            path_line(&path, &ports),
            "gpu0 > leaf0 >#4 spine1 >#5 leaf1 > gpu3"
        );
        // Without the ports (an older daemon's reply): the vertices alone.
        assert_eq!(
            path_line(&path, &[]),
            "gpu0 > leaf0 > spine1 > leaf1 > gpu3"
        );
    }
}
