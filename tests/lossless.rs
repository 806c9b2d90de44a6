//! Lossless fabrics live, as root: PFC under an oversubscribed AllToAll (the agents' real
//! TCP traffic through TUNs) against the same fabric lossy, and a pause deadlock in a ring
//! of switches that `status` reports.

mod common;

use common::{closbox, closbox_ok, root_or_skip, serial, text, TestFabric};

/// 2 leaves of 3 GPUs under one spine, one uplink each: 3:1 at 1 Gbit/s, 128 KiB switch
/// buffers, jumbo frames; a preset's links and switches otherwise (`extra`: more
/// `[fabric]` lines).
fn three_to_one(preset: &str, extra: &str) -> String {
    format!(
        "time_scale = 50\npreset = \"{preset}\"\nmtu = 9000\n{extra}\n[nic]\nbuffer = \"16MiB\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\ngpus_per_leaf = 3\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[links.leaf-spine]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[switches.leaf]\nbuffer = \"128KiB\"\n[switches.spine]\nbuffer = \"128KiB\"\n"
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

/// The RoCE demonstration: AllToAll at 3:1 drops at the oversubscribed uplinks of the
/// `ethernet-lossy` fabric; on `roce-400g` (PFC, ECN) nothing is dropped, the GPUs' NICs
/// are paused instead, status and the bench footer count the pauses.
#[test]
fn pfc_takes_the_drops_out_of_an_oversubscribed_alltoall() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let lossy = TestFabric::up("ll-lossy", &three_to_one("ethernet-lossy", ""));
    let (lossy_bw, st, _) = alltoall(&lossy);
    lossy.down();
    let lossy_drops = drops(&st, "buffer_full");
    assert!(lossy_drops > 0, "the 3:1 uplinks drop: {st}");
    assert_eq!(st["flow_control"], "none");

    // xoff 64 KiB: with the preset's 256 KiB, ECN-paced TCP got the NICs paused only once
    // or twice in a 1 MiB run.
    let pfc = TestFabric::up("ll-pfc", &three_to_one("roce-400g", "xoff = \"64KiB\""));
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
        "3:1 alltoall 1 MiB: ethernet-lossy busbw {lossy_bw:.4} GB/s with {lossy_drops} drops; roce-400g {pfc_bw:.4} GB/s, 0 drops, pauses {paused:?}"
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
        closbox_ok(&[
            "load", &from, &to, "--rate", "1Gbit", "--for", "20ms", "--fabric", "ll-ring",
        ]);
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
    // One counter summed over the loads.
    let total = |key: &str| -> u64 {
        st["loads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l[key].as_u64().unwrap())
            .sum()
    };
    let (delivered, sent) = (total("delivered_bytes"), total("sent_bytes"));
    assert!(
        delivered < sent / 2,
        "held in the ring: {delivered} of {sent} B"
    );
}

/// 2 leaves of 4 GPUs under one spine (1 Gbit/s NICs, 4 Gbit/s uplinks: non-blocking),
/// time_scale 20; `flow_control` lines after the fabric's name.
fn incast_fabric(flow_control: &str) -> String {
    format!(
        "time_scale = 20\n{flow_control}\n[nic]\nbuffer = \"4MiB\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\ngpus_per_leaf = 4\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[links.leaf-spine]\nrate = \"4Gbit\"\ndelay = \"1us\"\n[switches.leaf]\nbuffer = \"256KiB\"\n[switches.spine]\nbuffer = \"256KiB\"\n"
    )
}

/// An incast from leaf1's gpu5–gpu7 into gpu0 (3 Gbit/s into a 1 Gbit/s port), and an
/// innocent TCP flow (iperf3) from gpu4, also on leaf1, to gpu1, which is not congested.
/// Returns the innocent flow's rate in fabric bits/s and the status (all ports) at its end.
fn incast_with_innocent(f: &TestFabric) -> (f64, serde_json::Value) {
    for s in 5..8 {
        let from = format!("gpu{s}");
        closbox_ok(&[
            "load", &from, "gpu0", "--rate", "1Gbit", "--for", "300ms", "--fabric", &f.name,
        ]);
    }
    let mut server = f.spawn("gpu1", &["iperf3", "-s", "-1", "-B", "198.18.0.2"]);
    common::wait_for_port(f, "gpu1", 5201);
    let out = f.exec("gpu4", &["iperf3", "-c", "198.18.0.2", "-t", "3", "-J"]);
    let _ = server.wait();
    assert!(out.status.success(), "{:?}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let wall_bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    let all = closbox(&["status", &f.name, "--json", "--ports=->"]);
    let st: serde_json::Value = serde_json::from_slice(&all.stdout).unwrap();
    (wall_bps * 20.0, st[0].clone())
}

fn port<'a>(st: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    st["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == name)
        .unwrap_or_else(|| panic!("no port {name}"))
}

/// Congestion spreading, live: lossy, the incast drops at leaf0's port to gpu0 and the
/// innocent flow keeps its rate; with PFC nothing is dropped in the fabric, the pauses
/// climb from leaf0 to the spine, to leaf1's uplink and to the GPUs' NICs behind it, and
/// the innocent flow, queued behind the paused uplink, is slowed.
#[test]
fn pfc_spreads_an_incast_to_an_innocent_flow() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let lossy = TestFabric::up("ll-inl", &incast_fabric(""));
    let (lossy_bps, st) = incast_with_innocent(&lossy);
    lossy.down();
    assert!(
        port(&st, "leaf0->gpu0")["load_drops"].as_u64().unwrap() > 0,
        "lossy: the incast drops at gpu0's port"
    );
    assert!(
        lossy_bps > 0.5e9,
        "lossy: the innocent flow keeps its rate: {lossy_bps}"
    );

    let pfc = TestFabric::up(
        "ll-inp",
        &incast_fabric("flow_control = \"pfc\"\nxoff = \"64KiB\""),
    );
    let (pfc_bps, st) = incast_with_innocent(&pfc);
    pfc.down();
    for p in st["ports"].as_array().unwrap() {
        if !p["port"].as_str().unwrap().starts_with("gpu") {
            assert_eq!(p["load_drops"], 0, "no fabric drops: {p}");
            assert_eq!(p["drops_buffer"], 0, "no fabric drops: {p}");
        }
    }
    for name in ["spine0->leaf0", "leaf1->spine0", "gpu4->leaf1"] {
        let events = port(&st, name)["pause_events"].as_u64().unwrap();
        assert!(events > 0, "{name} was paused");
    }
    eprintln!(
        "innocent flow beside a 3:1 incast: lossy {:.0} Mbit/s, pfc {:.0} Mbit/s (fabric time)",
        lossy_bps / 1e6,
        pfc_bps / 1e6
    );
    assert!(
        pfc_bps < 0.7 * lossy_bps,
        "the innocent flow is slowed: {pfc_bps} vs {lossy_bps}"
    );
}
