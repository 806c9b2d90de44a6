//! Lossless fabrics live, as root: PFC under an oversubscribed AllToAll (the agents' real
//! TCP traffic through TUNs) against the same fabric lossy, and a pause deadlock in a ring
//! of switches that `status` reports.

mod common;

use common::{closbox, root_or_skip, serial, text, TestFabric};

/// 2 leaves of 3 GPUs under one spine, one uplink each: 3:1 at 1 Gbit/s, 128 KiB switch
/// buffers; `flow_control` lines after the fabric's name.
fn three_to_one(flow_control: &str) -> String {
    format!(
        "time_scale = 50\n{flow_control}\n[nic]\nbuffer = \"16MiB\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\ngpus_per_leaf = 3\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[links.leaf-spine]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[switches.leaf]\nbuffer = \"128KiB\"\n[switches.spine]\nbuffer = \"128KiB\"\n"
    )
}

fn drops(st: &serde_json::Value, reason: &str) -> u64 {
    st["drops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d[0] == reason)
        .and_then(|d| d[1].as_u64())
        .unwrap()
}

/// Runs `bench alltoall` at 1 MiB and returns its mean busbw, the status after, and the
/// bench's stderr (its footer).
fn alltoall(f: &TestFabric) -> (f64, serde_json::Value, String) {
    let out = closbox(&[
        "bench", "alltoall", "--fabric", &f.name, "--sizes", "1M", "--iters", "3", "--json",
    ]);
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&o).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["wrong"], 0, "{}", rows[0]);
    (rows[0]["busbw"].as_f64().unwrap(), f.status(), e)
}

/// The RoCE-style demonstration: AllToAll at 3:1 drops at the oversubscribed uplinks of
/// the lossy fabric; with PFC nothing is dropped, the GPUs' NICs and the leaves' uplinks
/// are paused instead, status and the bench footer count the pauses.
#[test]
fn pfc_takes_the_drops_out_of_an_oversubscribed_alltoall() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let lossy = TestFabric::up("ll-lossy", &three_to_one(""));
    let (lossy_bw, st, _) = alltoall(&lossy);
    lossy.down();
    let lossy_drops = drops(&st, "buffer_full");
    assert!(lossy_drops > 0, "the 3:1 uplinks drop: {st}");
    assert_eq!(st["flow_control"], "none");

    let pfc = TestFabric::up(
        "ll-pfc",
        &three_to_one("flow_control = \"pfc\"\nxoff = \"64KiB\""),
    );
    let (pfc_bw, st, footer) = alltoall(&pfc);
    let deadlocked = st["deadlocked"].as_array().unwrap().len();
    let ports = closbox(&["status", "ll-pfc", "--json", "--ports=->"]);
    pfc.down();
    assert_eq!(st["flow_control"], "pfc");
    assert_eq!(drops(&st, "buffer_full"), 0, "lossless: {st}");
    assert_eq!(deadlocked, 0);
    let all: serde_json::Value = serde_json::from_slice(&ports.stdout).unwrap();
    let paused: Vec<(String, u64)> = all[0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pause_events"].as_u64().unwrap() > 0)
        .map(|p| {
            (
                p["port"].as_str().unwrap().to_owned(),
                p["pause_events"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(
        paused.iter().any(|(p, _)| p.starts_with("gpu")),
        "the senders' NICs are paused: {paused:?}"
    );
    assert!(
        paused.iter().all(|(p, _)| !p.contains("->gpu")),
        "GPUs never pause the fabric: {paused:?}"
    );
    let line = footer
        .lines()
        .find(|l| l.starts_with("# lossless (pfc) during the run: "))
        .unwrap_or_else(|| panic!("no pause footer in\n{footer}"));
    assert!(!line.contains(": 0 pause events"), "{line}");
    eprintln!(
        "3:1 alltoall 1 MiB: lossy busbw {lossy_bw:.4} GB/s with {lossy_drops} drops; pfc {pfc_bw:.4} GB/s, 0 drops, pauses {paused:?}"
    );
}

/// Five switches in a ring, each GPU sending (synthetic load, at its NIC's rate) to the GPU
/// two switches on: every ring link is offered twice its rate and every switch's ingress
/// from the ring waits on the next ring link. With PFC the pauses close the cycle: the
/// ring stops for good, and `status` says DEADLOCK and exits 3; nothing was dropped.
#[test]
fn a_pfc_ring_deadlocks_and_status_reports_it() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let mut body = String::from(
        "time_scale = 10\nflow_control = \"pfc\"\nxoff = \"32KiB\"\ndeadlock_after = \"1ms\"\n[nic]\nbuffer = \"4MiB\"\n[topology]\nkind = \"custom\"\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[links.leaf-spine]\nrate = \"1Gbit\"\ndelay = \"1us\"\n",
    );
    for i in 0..5 {
        body += &format!(
            "[[switch]]\nname = \"s{i}\"\ntier = \"leaf\"\n[[host]]\nname = \"g{i}\"\n[[link]]\na = \"g{i}\"\nb = \"s{i}\"\n"
        );
    }
    for i in 0..5 {
        body += &format!(
            "[[link]]\na = \"s{i}\"\nb = \"s{}\"\nclass = \"leaf-spine\"\n",
            (i + 1) % 5
        );
    }
    let f = TestFabric::up("ll-ring", &body);
    for i in 0..5 {
        let (from, to) = (format!("g{i}"), format!("g{}", (i + 2) % 5));
        let out = closbox(&[
            "load", &from, &to, "--rate", "1Gbit", "--for", "20ms", "--fabric", "ll-ring",
        ]);
        assert!(out.status.success(), "{:?}", text(&out));
    }
    // 20 ms of load and the 1 ms bound are 210 ms of wall time at time_scale 10.
    let mut st = f.status();
    for _ in 0..100 {
        if st["deadlocked"].as_array().unwrap().len() >= 5 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        st = f.status();
    }
    let out = closbox(&["status", "ll-ring"]);
    let (o, _) = text(&out);
    f.down();
    let stuck: Vec<&str> = st["deadlocked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d[0].as_str().unwrap())
        .collect();
    for i in 0..5 {
        let ring_port = format!("s{i}->s{}", (i + 1) % 5);
        assert!(
            stuck.contains(&ring_port.as_str()),
            "{ring_port}: {stuck:?}"
        );
    }
    assert_eq!(out.status.code(), Some(3), "status exits 3:\n{o}");
    assert!(o.contains("DEADLOCK  "), "{o}");
    assert_eq!(drops(&st, "buffer_full"), 0);
    let delivered: u64 = st["loads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["delivered_bytes"].as_u64().unwrap())
        .sum();
    let sent: u64 = st["loads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["sent_bytes"].as_u64().unwrap())
        .sum();
    assert!(
        delivered < sent / 2,
        "held in the ring: {delivered} of {sent} B"
    );
}
