//! A live fabric that changes while it runs, as root: links and switches going down and
//! coming back, degraded links, the event log, bad names.

mod common;

use std::time::Duration;

use common::{closbox, leaf_spine_4, root_or_skip, serial, text, wait_for_port, TestFabric};

fn fabric() -> String {
    format!(
        "failure_detection = \"1ms\"\nroute_convergence = \"50ms\"\n{}",
        leaf_spine_4("1Gbit", "5us")
    )
}

fn port_tx(f: &TestFabric, port: &str) -> u64 {
    let out = closbox(&["status", &f.name, "--json", "--ports", port]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == port)
        .map_or(0, |p| p["tx_packets"].as_u64().unwrap())
}

fn drops(f: &TestFabric, reason: &str) -> u64 {
    let v = f.status();
    v["drops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d[0] == reason)
        .unwrap()[1]
        .as_u64()
        .unwrap()
}

fn ping(f: &TestFabric, from: &str, to: &str) -> bool {
    f.exec(from, &["ping", "-c", "3", "-i", "0.2", "-W", "1", "-q", to])
        .status
        .success()
}

#[test]
fn links_and_switches_go_down_and_come_back() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-chaos", &fabric());
    let fab = ["--fabric", "lt-chaos"];
    let run = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(fab);
        closbox(&a)
    };

    // Bad names: usage errors that say what exists.
    let out = run(&["link", "down", "leaf0", "spine9"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).1.contains("names here: spine0, spine1"),
        "{:?}",
        text(&out)
    );
    let out = run(&["link", "down", "gpu0", "gpu3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).1.contains("gpu0 links to leaf0"),
        "{:?}",
        text(&out)
    );
    let out = run(&["switch", "down", "gpu0"]);
    assert_eq!(out.status.code(), Some(2));

    // One uplink of leaf0 down: TCP across the leaves still gets through, and nothing
    // more leaves on the dead port.
    let out = run(&["link", "down", "leaf0", "spine0"]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(text(&out).0.contains("link leaf0-spine0 #0 down"));
    std::thread::sleep(Duration::from_millis(100));
    let dead_before = port_tx(&f, "leaf0->spine0");
    let mut server = f.spawn("gpu3", &["iperf3", "-s", "-1", "-B", "198.18.0.4"]);
    wait_for_port(&f, "gpu3", 5201);
    let out = f.exec(
        "gpu0",
        &["iperf3", "-c", "198.18.0.4", "-t", "2", "-P", "4", "-J"],
    );
    let _ = server.wait();
    assert!(out.status.success(), "{:?}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    eprintln!("iperf3 with leaf0-spine0 down: {:.0} Mbit/s", bps / 1e6);
    assert!(bps > 100e6, "{bps}");
    assert_eq!(
        port_tx(&f, "leaf0->spine0"),
        dead_before,
        "traffic on a dead link"
    );
    let st = f.status();
    let changed = st["changed_links"].as_array().unwrap();
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0]["link"], "leaf0-spine0 #0");
    assert_eq!(changed[0]["up"], false);

    // Both spines down: no path between the leaves (counted as no_route); back up, it
    // works again once routes converge.
    for s in ["spine0", "spine1"] {
        assert!(run(&["switch", "down", s]).status.success());
    }
    std::thread::sleep(Duration::from_millis(100));
    let before = drops(&f, "no_route") + drops(&f, "link_down");
    assert!(!ping(&f, "gpu0", "gpu3"), "no path, yet ping got through");
    assert!(drops(&f, "no_route") + drops(&f, "link_down") > before);
    assert!(ping(&f, "gpu0", "gpu1"), "within a leaf nothing changed");
    for s in ["spine0", "spine1"] {
        assert!(run(&["switch", "up", s]).status.success());
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(ping(&f, "gpu0", "gpu3"));

    // A partition: gpu0 cut off from the rest, both ways, until healed.
    let out = run(&["partition", "gpu0"]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(
        text(&out).0.contains("partition gpu0 | the rest"),
        "{:?}",
        text(&out)
    );
    let before = drops(&f, "partitioned");
    assert!(!ping(&f, "gpu0", "gpu3"));
    assert!(!ping(&f, "gpu3", "gpu0"));
    assert!(ping(&f, "gpu1", "gpu3"));
    assert!(drops(&f, "partitioned") > before);
    assert_eq!(f.status()["partition"][0][0], "gpu0");
    let out = run(&["partition", "gpu0", "0"]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(run(&["heal"]).status.success());
    assert!(ping(&f, "gpu0", "gpu3"));

    // A degraded link, then reset; the event log has it all, in order.
    let out = run(&[
        "link", "set", "gpu3", "leaf1", "--rate", "100Mbit", "--delay", "50us",
    ]);
    assert!(out.status.success(), "{:?}", text(&out));
    let st = f.status();
    assert_eq!(st["changed_links"][0]["rate_bps"], 100_000_000);
    assert!(run(&["link", "reset", "gpu3", "leaf1"]).status.success());
    assert!(f.status()["changed_links"].as_array().unwrap().is_empty());
    // A flap, on schedule: down 100 ms, up 100 ms, twice.
    let out = run(&[
        "link", "flap", "gpu3", "leaf1", "--down", "100ms", "--up", "100ms", "--count", "2",
    ]);
    assert!(out.status.success(), "{:?}", text(&out));
    std::thread::sleep(Duration::from_millis(600));
    assert!(ping(&f, "gpu0", "gpu3"), "the flap is over");
    let out = run(&["events", "--json"]);
    let events: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let what: Vec<&str> = events.iter().map(|e| e["what"].as_str().unwrap()).collect();
    assert_eq!(what.first(), Some(&"link leaf0-spine0 #0 down"));
    assert_eq!(what.last(), Some(&"link gpu3-leaf1 #0 up (flap 2 of 2)"));
    assert!(what.contains(&"link gpu3-leaf1 #0 reset to the topology's values"));
    assert_eq!(what.iter().filter(|w| w.contains("(flap")).count(), 4);
    assert!(what.contains(&"link leaf0-spine0 #0 down (already so)"));
    let times: Vec<u64> = events
        .iter()
        .map(|e| e["fabric_ns"].as_u64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]));
    f.down();
}

#[test]
fn a_gloo_job_fails_on_a_partition_within_its_timeout_and_runs_after_heal() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let f = TestFabric::up("lt-part", &fabric());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/allreduce_loop_gloo.py"
    );
    let job = |seconds: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_closbox"))
            .args([
                "run",
                "--fabric",
                "lt-part",
                "--timeout",
                "120",
                "--",
                "/usr/bin/python3",
                script,
                seconds,
                "5",
            ])
            .output()
            .unwrap()
    };
    // Cut gpu3 off while the job runs: it fails within gloo's 5 s timeout.
    let started = std::time::Instant::now();
    let running = std::thread::spawn(move || job("30"));
    std::thread::sleep(Duration::from_secs(8));
    let out = closbox(&["partition", "gpu3", "--fabric", "lt-part"]);
    assert!(out.status.success(), "{:?}", text(&out));
    let out = running.join().unwrap();
    let took = started.elapsed();
    let (o, e) = text(&out);
    eprintln!(
        "under a partition: exit {:?} after {took:?}\n{e}",
        out.status.code()
    );
    assert!(!out.status.success(), "{o}\n{e}");
    assert!(
        e.contains("failed") && e.contains("the other ranks were stopped"),
        "{e}"
    );
    assert!(
        took < Duration::from_secs(30),
        "not within its timeout: {took:?}"
    );
    assert!(f.status()["drops"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| d[0] == "partitioned" && d[1].as_u64().unwrap() > 0));
    // Healed, the same job runs through.
    assert!(closbox(&["heal", "--fabric", "lt-part"]).status.success());
    let out = job("2");
    let (o, e) = text(&out);
    assert!(out.status.success(), "{o}\n{e}");
    for r in 0..4 {
        assert!(o.contains(&format!("[{r}] rank {r}: ")), "{o}");
    }
    f.down();
}
