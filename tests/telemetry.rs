//! Seeing what a live fabric does, as root: packet captures read by tcpdump and tshark.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{closbox, root_or_skip, scratch_dir, serial, text, wait_for_port, TestFabric};

/// 8 GPUs under one 1 Gbit/s switch with 256 KiB port buffers.
const INCAST: &str = r#"
[topology]
kind = "single-switch"
gpus = 8
[links.nic]
rate = "1Gbit"
delay = "2us"
[switches.leaf]
latency = "500ns"
buffer = "256KiB"
"#;

fn port(f: &TestFabric, name: &str) -> serde_json::Value {
    let out = closbox(&["status", &f.name, "--json", "--ports", name]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no port {name}"))
}

/// Lines of a tool's output reading `file`.
fn read_with(tool: &str, args: &[&str]) -> String {
    let out = Command::new(tool).args(args).output().unwrap();
    assert!(out.status.success(), "{tool} {args:?}: {:?}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_capture_of_an_incast_holds_what_the_port_sent_and_dropped() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-cap", INCAST);
    let file = scratch_dir().join("incast.pcapng");
    // Bad selections are usage errors naming what exists.
    let out = closbox(&[
        "capture",
        "--fabric",
        "lt-cap",
        "--port",
        "sw0->gpu9",
        "-w",
        "/dev/null",
    ]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("ports of sw0: sw0->gpu0"),
        "{:?}",
        text(&out)
    );
    let out = closbox(&["capture", "--fabric", "lt-cap", "-w", "/dev/null"]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));

    let mut cap = Command::new(env!("CARGO_BIN_EXE_closbox"))
        .args([
            "capture",
            "--fabric",
            "lt-cap",
            "--port",
            "sw0->gpu0",
            "--drops",
            "--snaplen",
            "96",
            "-w",
        ])
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // 7 → 1: an iperf3 server per sender in gpu0, all senders at once for 2 s.
    let mut servers = Vec::new();
    for i in 1..=7 {
        let p = (5200 + i).to_string();
        servers.push(f.spawn(
            "gpu0",
            &["iperf3", "-s", "-1", "-p", &p, "-B", "198.18.0.1"],
        ));
        wait_for_port(&f, "gpu0", 5200 + i as u16);
    }
    let clients: Vec<_> = (1..=7)
        .map(|i| {
            let (gpu, p) = (format!("gpu{i}"), (5200 + i).to_string());
            std::thread::spawn(move || {
                closbox(&[
                    "exec",
                    "--fabric",
                    "lt-cap",
                    &gpu,
                    "--",
                    "iperf3",
                    "-c",
                    "198.18.0.1",
                    "-p",
                    &p,
                    "-t",
                    "2",
                ])
            })
        })
        .collect();
    for c in clients {
        let out = c.join().unwrap();
        assert!(out.status.success(), "{:?}", text(&out));
    }
    for mut s in servers {
        let _ = s.wait();
    }
    std::thread::sleep(Duration::from_millis(500));
    // Ctrl-C's signal: the capture ends with its statistics.
    Command::new("kill")
        .args(["-INT", &cap.id().to_string()])
        .status()
        .unwrap();
    let status = cap.wait().unwrap();
    let mut err = String::new();
    use std::io::Read;
    cap.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "{err}");

    let p = port(&f, "sw0->gpu0");
    let (tx, dropped) = (
        p["tx_packets"].as_u64().unwrap(),
        p["drops_buffer"].as_u64().unwrap() + p["drops_loss"].as_u64().unwrap(),
    );
    let path = file.to_str().unwrap();
    // tshark: every packet, the dropped ones with their reason in a comment.
    let all = read_with(
        "tshark",
        &["-r", path, "-T", "fields", "-e", "frame.number"],
    );
    let in_file = all.lines().count() as u64;
    let commented = read_with(
        "tshark",
        &[
            "-r",
            path,
            "-Y",
            "frame.comment contains \"buffer_full\"",
            "-T",
            "fields",
            "-e",
            "frame.number",
        ],
    )
    .lines()
    .count() as u64;
    // Capture drops, from the file's interface statistics.
    let stats = read_with("capinfos", &[path]);
    eprintln!("port sw0->gpu0: {tx} sent, {dropped} dropped; capture: {in_file} packets, {commented} marked dropped\n{err}");
    let not_kept: u64 = err
        .split("; ")
        .find_map(|s| {
            s.strip_suffix(
                " more not kept (the capture fell behind; counted in the file's statistics)\n",
            )
        })
        .map_or(0, |n| n.parse().unwrap());
    assert!(stats.contains("Number of interfaces in file: 1"), "{stats}");
    assert!(dropped > 0, "an incast into a 256 KiB buffer drops: {p}");
    // Every packet the port sent or dropped is in the file, or counted as not kept.
    assert_eq!(in_file + not_kept, tx + dropped, "{err}");
    if not_kept == 0 {
        assert_eq!(commented, dropped);
    } else {
        assert!(commented <= dropped);
    }
    // tcpdump reads it too, as raw IPv4 with nanosecond stamps.
    let out = Command::new("tcpdump")
        .args(["-nr", path, "--time-stamp-precision", "nano", "-c", "5"])
        .output()
        .unwrap();
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}{e}");
    assert!(e.contains("link-type IPV4"), "{e}");
    assert_eq!(o.lines().count(), 5, "{o}");
    assert!(o.contains("198.18.0.1.520"), "{o}");
    f.down();
}
